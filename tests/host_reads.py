"""Counting the host reads of torch tensor values inside `fit`.

A read of a device value on the host (`.item()`, `float(t)`, `.tolist()`,
`.numpy()`, `.cpu()`, `np.asarray(t)`) makes the host wait for the device:
on an accelerator every such read per step ends the overlap of host and
device work. On CPU there is no device to wait for, but the reads can be
counted: `HostReads` counts them (a torch function mode for the tensor
methods, the Python conversions patched for the span of the count).
`reads_per_step` runs a small `fit` of `S` and of `2 S` steps and returns
the difference divided by `S`: what each step reads, without what an
epoch reads once. On JAX, `jax_transfers_per_step` counts the same way
the copies of `jax.Array` values to the host (`ArrayImpl._value` where
no host copy is cached).
"""

import os

import numpy as np

#: Tensor methods that hand a value to the host.
READ_METHODS = ("item", "tolist", "numpy", "cpu")
#: Python conversions of a tensor, which no torch function mode sees.
READ_CONVERSIONS = ("__float__", "__int__", "__bool__", "__index__", "__array__")


def host_reads():
    """A context manager counting host reads: `with host_reads() as c: ...`,
    then `c.counts` maps each kind of read to its count."""
    import torch
    from torch.overrides import TorchFunctionMode

    class HostReads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.counts = {}
            self._saved = {}

        def _count(self, name):
            self.counts[name] = self.counts.get(name, 0) + 1

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in READ_METHODS:
                self._count(func.__name__)
            return func(*args, **(kwargs or {}))

        def __enter__(self):
            for name in READ_CONVERSIONS:
                original = getattr(torch.Tensor, name)
                self._saved[name] = original

                def counted(tensor, *args, _original=original, _name=name, **kwargs):
                    self._count(_name)
                    return _original(tensor, *args, **kwargs)

                setattr(torch.Tensor, name, counted)
            return super().__enter__()

        def __exit__(self, *exc):
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            return super().__exit__(*exc)

    return HostReads()


def _small_model_fit(steps, callbacks, read_logs):
    """A `fit` of a small model over `steps` batches of 64, run twice (the
    first compiles); returns a function running the second."""
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * steps, 32)).astype("float32")
    y = rng.normal(size=(64 * steps, 10)).astype("float32")
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    model.compile("sgd", "mse", metrics=["mae"])
    callbacks = list(callbacks)
    if read_logs:
        callbacks.append(
            keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: [float(v) for v in logs.values()]
            )
        )
    return model, x, y, callbacks


def jax_transfers_per_step(distribution, read_logs, steps=8):
    """The copies of device values to the host in one step of a small
    model's `fit` on JAX.

    Args:
        distribution: `"keras"` (Keras's own `DataParallel`, set before the
            model is built), `"keras_parallel"` (`ShardingCallback`), or
            None (one device).
        read_logs: a callback reads every batch's logs.
        steps: `S`.
    """
    import keras
    from jax._src import array as jax_array

    import keras_parallel

    def fit(steps):
        if distribution == "keras":
            keras.distribution.set_distribution(keras.distribution.DataParallel())
        doors = []
        if distribution == "keras_parallel":
            doors = [keras_parallel.ShardingCallback(keras_parallel.DataParallel())]
        try:
            model, x, y, callbacks = _small_model_fit(steps, doors, read_logs)
            options = dict(batch_size=64, epochs=1, verbose=0, callbacks=callbacks)
            model.fit(x, y, **options)
            copies = [0]
            value = jax_array.ArrayImpl._value

            def counted(array):
                if array._npy_value is None:
                    copies[0] += 1
                return value.fget(array)

            jax_array.ArrayImpl._value = property(counted)
            try:
                model.fit(x, y, **options)
            finally:
                jax_array.ArrayImpl._value = value
            return copies[0]
        finally:
            keras.distribution.set_distribution(None)

    return (fit(2 * steps) - fit(steps)) / steps


def _rows(x, y):
    """A torch `IterableDataset` of the rows of `x`, `y` (tensors): an input
    each rank reads whole, whose batches the ranks compare by checksum."""
    import torch

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(torch.as_tensor(x), torch.as_tensor(y), strict=True))

    return torch.utils.data.DataLoader(Rows(), batch_size=64)


def reads_per_step(distributed, read_logs, source="arrays", steps=8):
    """The host reads of one training step of a small model's `fit`.

    Args:
        distributed: `ShardingCallback(DataParallel())` (across the ranks
            this runs in), or plain Keras.
        read_logs: a callback reads every batch's logs, as a progress bar
            does.
        source: `"arrays"`, or `"iterable"`: a torch `IterableDataset`
            of tensors, read whole by every rank.
        steps: `S`.

    Returns:
        `{read: count per step}`.
    """

    import keras_parallel

    def fit(steps):
        doors = []
        if distributed:
            doors = [keras_parallel.ShardingCallback(keras_parallel.DataParallel())]
        model, x, y, callbacks = _small_model_fit(steps, doors, read_logs)
        inputs = dict(x=x, y=y, batch_size=64)
        if source == "iterable":
            inputs = dict(x=_rows(x, y))
        # The first fit compiles and builds; the second is counted.
        model.fit(**inputs, epochs=1, verbose=0, callbacks=callbacks)
        with host_reads() as reads:
            model.fit(**inputs, epochs=1, verbose=0, callbacks=callbacks)
        return reads.counts

    short, long = fit(steps), fit(2 * steps)
    names = set(short) | set(long)
    return {n: (long.get(n, 0) - short.get(n, 0)) / steps for n in sorted(names)}


def rank():
    return int(os.environ.get("RANK", "0"))
