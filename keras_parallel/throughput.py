"""`ThroughputMonitor`: how fast `fit` trains, in its logs.

Nothing is read from the device in a step: times are the host's, and samples
are Keras's loss tracker's count, read once an epoch (docs/throughput.md).
"""

import time

import keras

#: Vendors' dense peak FLOP/s, `{kind: (bf16/fp16, fp32)}` (fp32 without TF32);
#: kinds match by substring, case-insensitive.
PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "L4": (121e12, 30.3e12),
    "A10G": (70e12, 31.2e12),
    "V100": (125e12, 15.7e12),
    "TPU v5p": (459e12, None),
    "TPU v5 lite": (197e12, None),
    "TPU v4": (275e12, None),
}


class ThroughputMonitor(keras.callbacks.Callback):
    """Adds throughput to `fit`'s logs, every epoch (and every N steps).

    Logs, per epoch: `samples_per_second` (all devices together),
    `samples_per_second_per_device`, `step_time_ms`, and where known
    `tflops_per_device`, `mfu` (0 to 1) and `peak_memory_gb` (accelerators
    only). With `every_n_steps`, each N-th batch's logs get `step_time_ms`
    over the last N steps (and `samples_per_second` when `batch_size` is
    given). Put it before `CSVLogger` and `TensorBoard` in `callbacks`;
    `History` and the progress bar, which Keras adds after the user's
    callbacks, always see it.

    Args:
        every_n_steps: also log over every N training steps (None: per epoch
            only).
        batch_size: the global batch size, for the per-N-steps samples (the
            epoch's samples are counted).
        flops_per_sample: the training FLOPs of one sample (forward and
            backward); default `train_flops_per_sample(model)` where it is
            known.
        peak_flops: one device's peak FLOP/s for MFU; default from
            `PEAK_FLOPS` by the device's kind and the compute dtype (none on
            CPU, so no `mfu`).

    Example:

    ```python
    monitor = keras_parallel.ThroughputMonitor()
    history = model.fit(x, y, batch_size=512, epochs=3, callbacks=[monitor])
    history.history["samples_per_second"]   # one number per epoch
    ```
    """

    async_safe = True  # Reads only host clocks in the batch hooks.

    def __init__(
        self,
        every_n_steps=None,
        batch_size=None,
        flops_per_sample=None,
        peak_flops=None,
    ):
        super().__init__()
        if every_n_steps is not None and int(every_n_steps) < 1:
            raise ValueError(
                "`every_n_steps` must be a positive number of steps. "
                f"Received: every_n_steps={every_n_steps}; pass 1 or more, or "
                "None to log per epoch only."
            )
        self.every_n_steps = every_n_steps
        self.batch_size = batch_size
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        #: `(samples, seconds, steps)` of each epoch measured so far.
        self.epochs = []
        self._start = self._last_end = self._window_start = None
        self._steps = 0
        self._samples = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._window_start = time.perf_counter()
        self._last_end = None
        self._steps = 0
        self._samples = None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self._last_end = now
        self._steps += 1
        n = self.every_n_steps
        if n and self._steps % n == 0 and logs is not None:
            seconds = now - self._window_start
            logs["step_time_ms"] = 1000.0 * seconds / n
            if self.batch_size:
                logs["samples_per_second"] = n * self.batch_size / seconds
            self._window_start = now

    def on_test_begin(self, logs=None):
        # Validation inside `fit` resets the metrics: count the epoch's
        # samples first (the training metrics are the epoch's by now).
        if self._start is not None and self._samples is None:
            self._samples = _samples_counted(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if self._start is None or self._last_end is None or logs is None:
            return
        samples = self._samples
        if samples is None:
            samples = _samples_counted(self.model)
        seconds = self._last_end - self._start
        self.epochs.append((samples, seconds, self._steps))
        logs.update(self.throughput(samples, seconds, self._steps))
        self._start = None

    def throughput(self, samples, seconds, steps):
        """The logs of an epoch of `samples` in `seconds` over `steps`.

        Args:
            samples: the samples trained on (None if unknown).
            seconds: the time from the epoch's start to its last step's end.
        """
        out = {"step_time_ms": 1000.0 * seconds / max(steps, 1)}
        if not samples or seconds <= 0:
            return out
        devices = device_count()
        rate = samples / seconds
        out["samples_per_second"] = rate
        out["samples_per_second_per_device"] = rate / devices
        flops = self.flops_per_sample
        if flops is None:
            flops = train_flops_per_sample(self.model)
        if flops:
            per_device = flops * rate / devices
            out["tflops_per_device"] = per_device / 1e12
            peak = self.peak_flops or device_peak_flops(self.model)
            if peak:
                out["mfu"] = per_device / peak
        memory = peak_memory_bytes()
        if memory:
            out["peak_memory_gb"] = memory / 1e9
        return out


def _samples_counted(model):
    """The samples Keras's loss tracker counted this epoch, or None (a
    custom `train_step` without `compute_loss` has none)."""
    for metric in getattr(model, "metrics", []):
        if metric.name == "loss" and hasattr(metric, "count"):
            return float(keras.ops.convert_to_numpy(metric.count))
    return None


def train_flops_per_sample(model):
    """The training FLOPs of one sample, estimated from a built model's layers.

    Each `Dense`, `EinsumDense` and convolution costs `2 * kernel size` FLOPs
    at each position (token, output pixel); training is 3 times the forward
    pass. Other layers are not counted, as in `6 * parameters * tokens`.

    Returns:
        FLOPs per sample, or None where no such layer is built.

    Example:

    >>> # Dense 32 -> 64 -> 10: 3 * 2 * (32 * 64 + 64 * 10)
    >>> train_flops_per_sample(model)
    16128
    """
    forward = 0
    for layer in _layers(model):
        kernel = getattr(layer, "kernel", None)
        if kernel is None or not layer.built:
            continue
        size = 1
        for dim in kernel.shape:
            size *= int(dim)
        forward += 2 * size * _positions(layer)
    return 3 * forward or None


def _layers(model):
    """Every layer of a model, nested models' included."""
    for layer in getattr(model, "layers", []):
        yield layer
        yield from _layers(layer)


def _positions(layer):
    """How many times a layer applies its kernel to one sample."""
    try:
        if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
            inner = layer.input.shape[1:-1]
        elif "Conv" in type(layer).__name__:
            shape = layer.output.shape
            inner = shape[1:-1] if layer.data_format == "channels_last" else shape[2:]
        else:
            return 0
    except (AttributeError, ValueError):  # Not called symbolically: once.
        return 1
    positions = 1
    for dim in inner:
        positions *= int(dim) if dim is not None else 1
    return positions


def device_count():
    """The devices that train together: all of them, over every process."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.device_count()
    if backend == "torch":
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.distribute.get_strategy().num_replicas_in_sync
    return 1


def device_peak_flops(model):
    """One device's peak FLOP/s for the model's compute dtype, from
    `PEAK_FLOPS` by the device's kind, or None (a CPU, an unknown kind)."""
    kind = _device_kind()
    if not kind:
        return None
    half = getattr(model, "dtype_policy", None)
    half = half is not None and half.compute_dtype in ("bfloat16", "float16")
    for name, (bf16, fp32) in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return bf16 if half else fp32
    return None


def _device_kind():
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = jax.local_devices()[0]
        return None if device.platform == "cpu" else device.device_kind
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
        return None
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0])
            return details.get("device_name")
    return None


def peak_memory_bytes():
    """The peak memory of the first local accelerator, or None (CPU)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = jax.local_devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        return (stats or {}).get("peak_bytes_in_use")
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated()
        return None
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            return tf.config.experimental.get_memory_info("GPU:0")["peak"]
    return None
