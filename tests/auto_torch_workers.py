"""What the torch `Auto` tests run in every rank (and the models in one).

Spawned processes import these by name, so they live outside the test
module. Each rank predicts every candidate for the MLP and the small KerasHub
Llama (`choose(predict_all=True)`), finds the candidate each budget chooses
at every reachable threshold, then trains under `Auto` given the budget of
the candidate that needs least, through `compile(distribution=Auto(...))`.
Results are plain Python values.
"""

import os
import traceback

from keras_parallel.keras_seam.model_state import binding_of

os.environ.setdefault("KERAS_BACKEND", "torch")

FEATURES, HIDDEN, OUTPUTS = 64, 512, 64
#: The global batch each model trains on.
BATCH = {"mlp": 64, "llama": 16}


def model(name, model_class, probe=False):
    """The MLP of `test_auto.py`, or `hub_models`' small Llama."""
    import keras

    keras.utils.set_random_seed(3)
    if name == "llama":
        import hub_models

        return hub_models.model("llama", probe=probe, model_class=model_class)
    import split_probe

    inputs = keras.Input((FEATURES,))
    x = split_probe.probe()(inputs) if probe else inputs
    x = keras.layers.Dense(HIDDEN, activation="relu", name="d1")(x)
    x = keras.layers.Dense(HIDDEN, activation="relu", name="d2")(x)
    return model_class(inputs, keras.layers.Dense(OUTPUTS, name="d3")(x))


def data(name):
    """Two global batches of `name`'s inputs and targets."""
    import numpy as np

    if name == "llama":
        import hub_models

        return hub_models.batch("llama", 2 * BATCH[name])
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(2 * BATCH[name], FEATURES)).astype("float32"),
        rng.normal(size=(2 * BATCH[name], OUTPUTS)).astype("float32"),
    )


def _first_batch(x, y, rows):
    if isinstance(x, dict):
        return {k: v[:rows] for k, v in x.items()}, y[:rows], None
    return x[:rows], y[:rows], None


def compiled(model_, distribution=None):
    import keras

    kwargs = {} if distribution is None else {"distribution": distribution}
    model_.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **kwargs)
    return model_


def trained(name, model_):
    """The weights after two steps of one epoch, as NumPy arrays."""
    import numpy as np

    x, y = data(name)
    model_.fit(x, y, batch_size=BATCH[name], epochs=1, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model_.get_weights()]


def auto_ranks(names=("mlp", "llama")):
    """Each of `names`: needs, thresholds, and a run `Auto` chose; and the
    MLP's run through a `ShardingCallback(Auto(...))` (`"callback"`)."""
    results = {name: _auto_model(name) for name in names}
    if "budget" in results.get("mlp", {}):
        results["callback"] = _through_a_callback("mlp", results["mlp"]["budget"])
    results["refused"] = _nothing_fits()
    return results


def _nothing_fits():
    """The error each rank raises for a budget nothing fits, and whether
    its weights were left as they were."""
    import keras
    import numpy as np

    import keras_parallel

    try:
        Net = type("Net", (keras_parallel.DistributedModel, keras.Model), {})
        run = compiled(model("mlp", Net), keras_parallel.Auto(device_memory="64KB"))
        before = [np.asarray(w) for w in run.get_weights()]
        x, y = data("mlp")
        try:
            run.fit(x, y, batch_size=BATCH["mlp"], verbose=0)
        except ValueError as error:
            after = [np.asarray(w) for w in run.get_weights()]
            unchanged = all(
                np.array_equal(a, b) for a, b in zip(before, after, strict=True)
            )
            return {"message": str(error), "unchanged": unchanged}
        return {"error": "fit did not refuse a budget nothing fits"}
    except Exception:
        return {"error": traceback.format_exc()}


def _through_a_callback(name, budget):
    import keras
    import split_probe

    import keras_parallel

    try:
        callback = keras_parallel.ShardingCallback(
            keras_parallel.Auto(device_memory=budget, headroom=0)
        )
        run = compiled(model(name, keras.Model, probe=True))
        split_probe.clear()
        x, y = data(name)
        run.fit(
            x,
            y,
            batch_size=BATCH[name],
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[callback],
        )
        import numpy as np

        return {
            "held": _held_in_part(run),
            "chosen": callback.binding.choice.chosen.name,
            "first_fitting": _first_fitting(callback.binding.choice),
            "weights": [np.asarray(w) for w in run.get_weights()],
            "split": split_probe.records(),
        }
    except Exception:
        return {"error": traceback.format_exc()}


def _auto_model(name):
    import keras
    import split_probe

    import keras_parallel
    from keras_parallel.auto import choice as auto_choice
    from keras_parallel.backends.torch.executor import TorchExecutor

    try:
        devices = TorchExecutor.list_devices()
        probe = compiled(model(name, keras.Model))
        probe.optimizer.build(probe.trainable_variables)
        batch = _first_batch(*data(name), BATCH[name])

        def choose(budget, predict_all=False):
            return auto_choice.choose(
                keras_parallel.Auto(device_memory=budget, headroom=0),
                probe,
                batch,
                TorchExecutor,
                devices,
                predict_all=predict_all,
            )

        needs = choose(2**50, predict_all=True).candidates
        thresholds = []
        for index, candidate in enumerate(needs):
            need = candidate.bytes_per_device
            earlier = [c.bytes_per_device for c in needs[:index]]
            if need is None or not all(e is None or need < e for e in earlier):
                continue
            try:
                below = choose(need - 1).chosen.name
            except ValueError:
                below = None
            thresholds.append((candidate.name, need, choose(need).chosen.name, below))
        # The candidate that needs least, chosen by `fit` itself, half-way
        # to the need before it (the first `fit` measures its step anew).
        target, before = thresholds[-1], thresholds[-2]
        budget = (target[1] + before[1]) // 2
        Net = type("Net", (keras_parallel.DistributedModel, keras.Model), {})
        run = compiled(
            model(name, Net, probe=True),
            keras_parallel.Auto(device_memory=budget, headroom=0),
        )
        split_probe.clear()
        weights = trained(name, run)
        return {
            "budget": budget,
            "held": _held_in_part(run),
            "needs": [(c.name, c.bytes_per_device, c.refused) for c in needs],
            "thresholds": thresholds,
            "target": target[0],
            "chosen": binding_of(run).choice.chosen.name,
            "first_fitting": _first_fitting(binding_of(run).choice),
            "distribution": type(run.distribution).__name__,
            "weights": weights,
            "split": split_probe.records(),
        }
    except Exception:
        return {"error": traceback.format_exc()}


def _first_fitting(choice):
    """The first candidate of `fit`'s own table whose predicted need is
    within its budget: what `Auto` must have chosen (read from the table,
    not through `auto_choice`'s own choice)."""
    return next(
        c.name
        for c in choice.candidates
        if c.bytes_per_device is not None and c.bytes_per_device <= choice.budget
    )


def _held_in_part(model_):
    """The paths of the model and optimizer variables this rank holds a
    part of (a DTensor whose local shard is smaller than the whole)."""
    variables = list(model_.variables) + list(model_.optimizer.variables)
    held = []
    for variable in variables:
        value = variable.value
        if hasattr(value, "to_local") and value.to_local().numel() < value.numel():
            held.append(variable.path)
    return held
