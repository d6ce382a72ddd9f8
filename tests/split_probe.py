"""Proof that the work was divided: the rows one device computed in a step.

Equal weights do not prove distribution: a step in which every device
computes the whole global batch gives the same weights as one in which each
computes its share. So every equivalence test also puts a `BatchProbe` (an
identity layer, no variables) in its models and checks what it recorded
with `assert_divided`:

- JAX: the batch's sharding inside the compiled step
  (`jax.debug.inspect_array_sharding`, read when the step is compiled): the
  global rows and the rows of one device's shard.
- torch: the rows this rank's `call` received (not a `meta` tensor from a
  symbolic build); for a DTensor input, the rows of this rank's shard;
  under `torch.compile`, read as each step runs (a graph break).
- TensorFlow: the rows each replica's `call` received, read as the step runs.

Each record is `(global_rows, device_rows)`; `global_rows` is `None` where
one device cannot see it (torch, TensorFlow). Records are per process: a
multi-process worker returns `records()` to the test.
"""

_RECORDS = []
_CLASS = []


def records():
    """The `(global_rows, device_rows)` seen since the last `clear()`."""
    return list(_RECORDS)


def clear():
    _RECORDS.clear()


def _record_jax(x):
    import jax

    if not isinstance(x, jax.core.Tracer):
        return  # An eager call that builds the model, not a compiled step.
    global_rows = int(x.shape[0])

    def seen(sharding):
        # `shard_shape` refuses rows the devices do not divide; XLA gives
        # each device the rows rounded up (the last one padded).
        spec = getattr(sharding, "spec", None)
        if spec is None:
            rows = int(sharding.shard_shape(x.shape)[0])
        else:
            names = spec[0] if spec and spec[0] is not None else ()
            names = names if isinstance(names, tuple) else (names,)
            ways = 1
            for name in names:
                ways *= sharding.mesh.shape[name]
            rows = -(-global_rows // ways)
        _RECORDS.append((global_rows, rows))

    jax.debug.inspect_array_sharding(x, callback=seen)


def _record_torch(x):
    import torch

    # Under `torch.compile` (`jit_compile=True`) the probe runs as a graph
    # break, each step, on the real batch: traced, its record would be the
    # first step's, replayed.
    torch.compiler.disable(_record_torch_rows)(x)


def _record_torch_rows(x):
    if x.device.type == "meta":
        return  # A symbolic build, not a step.
    local = x.to_local() if hasattr(x, "to_local") else x
    global_rows = int(x.shape[0]) if local is not x else None
    _RECORDS.append((global_rows, int(local.shape[0])))


def _record_tensorflow(x):
    import numpy as np
    import tensorflow as tf

    def seen(rows):
        _RECORDS.append((None, int(rows)))
        return np.int32(0)

    # Runs when the step runs, once per replica: TensorFlow keeps a
    # stateful op of the step even though nothing reads its output.
    tf.numpy_function(seen, [tf.shape(x)[0]], tf.int32, stateful=True)


def record(x):
    """Records the rows of `x` one device holds, as a probe layer does.

    For a model a probe cannot be put in (the guide's convnet as the demo
    builds it): call it from a layer's `call`.
    """
    import keras

    recorders = {
        "jax": _record_jax,
        "torch": _record_torch,
        "tensorflow": _record_tensorflow,
    }
    recorders[keras.backend.backend()](x)


def probe(name="batch_probe"):
    """A new `BatchProbe` layer: put it first in a model (see module docstring).

    Args:
        name: the layer's name.

    Returns:
        A `keras.layers.Layer` that returns its input unchanged.
    """
    if not _CLASS:
        import keras

        @keras.saving.register_keras_serializable(package="split_probe")
        class BatchProbe(keras.layers.Layer):
            def call(self, x):
                record(x)
                return x

            def compute_output_spec(self, x):
                return keras.KerasTensor(x.shape, x.dtype)

        _CLASS.append(BatchProbe)
    return _CLASS[0](name=name)


def assert_divided(recorded, global_batch, ways, uneven_whole=False):
    """Asserts that every step's batch was split `ways` ways.

    No device computed more than its share of a global batch: `global_batch
    / ways` rows (rounded up; torch gives an uneven batch's extra rows to
    the first ranks). Where the global rows are known (JAX), each step's
    batch is at most `global_batch` rows and every batch is split: each
    device holds its rows rounded up (a batch the devices do not divide,
    `batch_size=100` or the last of an epoch, too). At least one whole
    global batch must have been split.

    Args:
        recorded: `records()` of one process (or several, concatenated).
        global_batch: the `batch_size` given to `fit`.
        ways: the devices (or processes) the batch is split over.
        uneven_whole: a batch that `ways` does not divide may be computed
            whole (JAX on a mesh with a second axis); a divisible one must
            still be split.
    """
    assert recorded, (
        "the BatchProbe saw no step: it must be in the model and the step "
        "must have run (or been compiled, on JAX) since clear()"
    )
    share = -(-global_batch // ways)
    whole_batches_split = 0
    for global_rows, device_rows in recorded:
        if global_rows is None:
            assert device_rows <= share, (
                f"one device computed {device_rows} rows of a global batch "
                f"of {global_batch} over {ways} devices: not split "
                f"(records: {recorded})"
            )
            whole_batches_split += device_rows == share
            continue
        assert global_rows <= global_batch, (
            f"a step saw a global batch of {global_rows} rows, more than "
            f"batch_size={global_batch} (records: {recorded})"
        )
        if uneven_whole and global_rows % ways and device_rows == global_rows:
            continue
        # Torch's DTensor gives an uneven batch's extra rows to the first
        # ranks; JAX's probe reports the rounded-up share.
        assert global_rows // ways <= device_rows <= -(-global_rows // ways), (
            f"a device held {device_rows} of {global_rows} rows over "
            f"{ways} devices: not split (records: {recorded})"
        )
        whole_batches_split += global_rows == global_batch
    assert whole_batches_split, (
        f"no global batch of {global_batch} rows was seen split {ways} ways "
        f"(records: {recorded})"
    )
