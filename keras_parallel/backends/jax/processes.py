"""What the JAX executor does differently when several processes run.

Under `jax.distributed` one mesh spans every process's devices. This module
holds the collectives, and places and fetches process-spanning arrays; in
one process none of it is used.
"""

import contextlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from keras_parallel.backends.jax import keras_compat
from keras_parallel.keras_seam.replacements import replaced
from keras_parallel.messages import wire


def is_multi_process():
    """Whether `jax.distributed` joined several processes."""
    return jax.process_count() > 1


def broadcast_values(values):
    """Process 0's `values` (NumPy arrays, the same shapes on every process)
    on every process."""
    if not is_multi_process() or not values:
        return values
    return list(multihost_utils.broadcast_one_to_all(list(values)))


def place(value, sharding):
    """Lays out a value every process holds whole, each process sending
    only its own devices' shards."""
    if not is_multi_process():
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def broadcast_bytes(payload, src=0):
    """Process `src`'s `payload` (bytes, read there only) on every process:
    two broadcasts."""
    if not is_multi_process():
        return payload
    is_source = jax.process_index() == src
    length = multihost_utils.broadcast_one_to_all(
        np.asarray(len(payload), np.int32), is_source=is_source
    )
    length = wire.checked_length(length, f"a value broadcast by process {src}")
    buffer = np.zeros(length, np.uint8)
    if is_source:
        buffer[:] = np.frombuffer(payload, np.uint8)
    buffer = multihost_utils.broadcast_one_to_all(buffer, is_source=is_source)
    return np.asarray(buffer, np.uint8).tobytes()


def allgather_bytes(payload):
    """Every process's `payload` (bytes, any length) on every process, by
    process index: two all-gathers."""
    if not is_multi_process():
        return [payload]
    lengths = np.asarray(
        multihost_utils.process_allgather(np.asarray([len(payload)], np.int64))
    ).ravel()
    lengths = [
        wire.checked_length(n, f"a value gathered from process {i}")
        for i, n in enumerate(lengths)
    ]
    buffer = np.zeros(max(lengths), np.uint8)
    buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer), np.uint8)
    gathered = gathered.reshape(len(lengths), -1)
    return [
        row[:length].tobytes() for row, length in zip(gathered, lengths, strict=True)
    ]


def reduce_sum(value):
    """The sum over processes of `value` (a number or NumPy array)."""
    if not is_multi_process():
        return value
    gathered = multihost_utils.process_allgather(np.asarray(value, np.float32))
    return np.asarray(gathered).sum(axis=0)


class CoordinationStore:
    """`jax.distributed`'s key-value store (its coordination service).

    JAX gives its client no public name: it is read where JAX's own
    `multihost_utils` and Orbax read it. The methods used exist from JAX 0.7.
    """

    def __init__(self):
        from jax._src import distributed

        self._client = distributed.global_state.client

    def set(self, key, value):
        self._client.key_value_set(key, value, allow_overwrite=True)

    def try_get(self, key):
        try:
            return self._client.key_value_try_get(key)
        except Exception as error:  # JaxRuntimeError, named NOT_FOUND.
            if "NOT_FOUND" in str(error):
                return None
            raise

    #: A `take` waits this long at a time, so that Python runs its signal
    #: handlers (a launcher's SIGTERM) between waits.
    TAKE_WAIT_MS = 1_000

    def put_bytes(self, key, payload):
        """Writes `payload` (bytes) under `key`, for one process to `take`."""
        self._client.key_value_set_bytes(key, payload)

    def take_bytes(self, key):
        """The bytes under `key`, once written; the key is then deleted."""
        while True:
            try:
                payload = self._client.blocking_key_value_get_bytes(
                    key, self.TAKE_WAIT_MS
                )
                break
            except Exception as error:  # JaxRuntimeError: not written yet.
                if "DEADLINE_EXCEEDED" not in str(error):
                    raise
        self._client.key_value_delete(key)
        return payload


def barrier():
    """Waits until every process gets here."""
    if is_multi_process():
        multihost_utils.sync_global_devices("keras_parallel")


def fetch(value):
    """The whole value of a (possibly process-spanning) `jax.Array`, as a
    NumPy array; anything else unchanged."""
    if not isinstance(value, jax.Array):
        return value
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


@contextlib.contextmanager
def gathered_for_saving(variables):
    """Keras's saving, on every process, of variables split across processes.

    Each process gathers the variables it does not hold whole (a collective:
    every process must save), and Keras's `convert_to_numpy` returns them.

    Args:
        variables: every variable the save may read, in the same order on
            every process.
    """
    gathered = {}
    for variable in variables:
        value = variable.value
        if isinstance(value, jax.Array) and not (
            value.is_fully_addressable or value.is_fully_replicated
        ):
            gathered[id(variable)] = fetch(value)
    keras_backend = keras_compat.numpy_conversion
    convert = keras_backend.convert_to_numpy

    def convert_gathered(x):
        found = gathered.get(id(x))
        return convert(x) if found is None else found

    with replaced({(keras_backend, "convert_to_numpy"): convert_gathered}):
        yield


def check_same_plan(plan):
    """Refuses processes that were given different distributions.

    Every process compares its plan's digest with every other's, so all of
    them raise rather than some training while the others wait for ever.

    Raises:
        ShardingError: on every process, naming the processes that differ.
    """
    if not is_multi_process():
        return
    import hashlib

    from keras_parallel.errors import ShardingError

    text = repr(
        (plan.mesh_shape, plan.axis_names, plan.batch_axis)
        + tuple((v.path, v.axes) for v in plan.variables)
    )
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    digests = np.asarray(
        multihost_utils.process_allgather(np.asarray([digest], np.int64))
    ).ravel()
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ShardingError(
            "The processes were given different distributions: every process "
            "must run the same script with the same distribution. Received: "
            f"process {jax.process_index()} planned mesh {plan.mesh_shape} "
            f"over {plan.axis_names}; processes {differ} differ from process 0. "
            "Build the distribution the same way on every process."
        )
