"""The random state a backup holds: the host's and the model's seed generators.

A resumed run draws what the uninterrupted run would have drawn: the host
random state (shuffles) and every seed generator's state (dropout masks),
kept as JSON in the backup's metadata.
"""

import base64

import numpy as np

from keras_parallel.persistence.backup_checks import BackupError


def random_state(model, executor):
    """The host random state and the model's seed generator states, as JSON.

    Args:
        model: the model whose seed generators are read.
        executor: the run's executor (its `checkpoint_io`).

    Returns:
        A dict of JSON values (`set_random_state` puts it back).
    """
    return {
        "host": _encode(executor.checkpoint_io.host_random_state()),
        "seed_generators": [
            np.asarray(executor.checkpoint_io.host_value(v.value)).tolist()
            for v in _seed_states(model)
        ],
    }


def set_random_state(model, executor, state):
    """Puts back what `random_state` read, each rank's seeds offset by rank.

    Raises:
        BackupError: the state holds another number of seed states (a
            backup of another model).
    """
    executor.checkpoint_io.set_host_random_state(_decode(state["host"]))
    saved = state["seed_generators"]
    variables = _seed_states(model)
    if len(saved) != len(variables):
        raise BackupError(
            f"the backup holds {len(saved)} random seed states and model "
            f"{model.name!r} has {len(variables)}. Received: a backup of "
            "another model; delete the backup folder to start afresh."
        )
    for variable, value in zip(variables, saved, strict=True):
        value = np.asarray(value, dtype=variable.dtype)
        variable.assign(executor.checkpoint_io.rank_seed_state(value))


def _seed_states(model):
    """The states of the model's seed generators (`Dropout(seed=...)`, ...).

    `model.variables` lists them, `model.weights` (what is saved) does not.
    """
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _encode(value):
    """NumPy arrays and bytes as JSON-safe tagged values; nests kept."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def _decode(value):
    if isinstance(value, dict):
        if "ndarray" in value:
            return np.asarray(value["ndarray"], dtype=value["dtype"])
        if "bytes" in value:
            return base64.b64decode(value["bytes"])
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        return {k: _decode(v) for k, v in value["dict"].items()}
    return value
