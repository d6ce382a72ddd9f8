"""`ThroughputMonitor`: the numbers it logs are the ones it measured, the
samples are the epoch's (not validation's), the FLOPs of a Dense stack are
counted by hand, and a distributed fit divides its rate by its devices."""

import keras
import numpy as np
import pytest

import keras_parallel
from keras_parallel import throughput

ROWS, BATCH = 1003, 64  # 16 steps, the last of 43 rows.


def dense_model(distributed=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    model.compile("sgd", "mse")
    return model


def data(rows=ROWS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32)).astype("float32")
    return x, rng.normal(size=(rows, 10)).astype("float32")


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        import time

        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        import time

        self.seconds = time.perf_counter() - self.start


def test_the_flops_of_a_dense_stack_are_counted_by_hand():
    model = dense_model()
    assert throughput.train_flops_per_sample(model) == 3 * 2 * (32 * 64 + 64 * 10)


def test_a_convolution_counts_every_output_pixel():
    inputs = keras.Input((8, 8, 3))
    conv = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    model = keras.Model(inputs, conv)
    assert throughput.train_flops_per_sample(model) == 3 * 2 * (3 * 3 * 3 * 4) * 64


def test_the_logs_hold_the_epochs_samples_rate_and_step_time():
    model = dense_model()
    x, y = data()
    monitor = keras_parallel.ThroughputMonitor(peak_flops=1e12)
    timer = EpochTimer()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        validation_data=data(301),  # Validation resets the loss tracker.
        callbacks=[monitor, timer],
    )
    samples, seconds, steps = monitor.epochs[-1]
    assert (samples, steps) == (ROWS, 16)
    # Training alone: within the epoch (which also validates).
    assert 0 < seconds <= timer.seconds
    logs = {k: v[-1] for k, v in history.history.items()}
    devices = throughput.device_count()
    assert logs["samples_per_second"] == pytest.approx(ROWS / seconds)
    assert logs["samples_per_second_per_device"] == pytest.approx(
        ROWS / seconds / devices
    )
    assert logs["step_time_ms"] == pytest.approx(1000 * seconds / 16)
    flops = 3 * 2 * (32 * 64 + 64 * 10)
    tflops = flops * ROWS / seconds / devices / 1e12
    assert logs["tflops_per_device"] == pytest.approx(tflops)
    assert logs["mfu"] == pytest.approx(tflops * 1e12 / 1e12)
    assert "peak_memory_gb" not in logs  # A CPU has none to report.
    assert len(history.history["samples_per_second"]) == 2


def test_every_n_steps_logs_the_window_with_the_batch_size():
    model = dense_model()
    x, y = data(BATCH * 8)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(dict(logs))
    )
    monitor = keras_parallel.ThroughputMonitor(every_n_steps=4, batch_size=BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor, record])
    windows = [i for i, logs in enumerate(seen) if "step_time_ms" in logs]
    assert windows == [3, 7]
    logs = seen[3]
    assert logs["samples_per_second"] == pytest.approx(
        4 * BATCH / (4 * logs["step_time_ms"] / 1000)
    )


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="8 JAX devices")
def test_a_distributed_fit_counts_the_global_batch_and_its_devices():
    samples, devices = _distributed_epoch()
    assert samples == ROWS  # The global batches', not a device's share.
    assert devices == pytest.approx(8)


def test_a_step_count_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="every_n_steps"):
        keras_parallel.ThroughputMonitor(every_n_steps=0)


def _distributed_epoch():
    model = dense_model()
    x, y = data()
    monitor = keras_parallel.ThroughputMonitor()
    door = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        validation_data=data(301),
        callbacks=[door, monitor],
    )
    logs = {k: v[-1] for k, v in history.history.items()}
    return monitor.epochs[-1][0], logs["samples_per_second"] / logs[
        "samples_per_second_per_device"
    ]


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch ranks")
def test_torch_ranks_count_the_global_batch_and_every_rank():
    from torch_launch import launch

    for samples, devices in launch(_distributed_epoch, 2, timeout=120):
        assert samples == ROWS  # Not a rank's half.
        assert devices == pytest.approx(2)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TF replicas")
def test_tensorflow_replicas_count_the_global_batch_and_every_replica():
    import tf_devices

    samples, devices = _distributed_epoch()  # The suite's 4 logical devices.
    assert samples == ROWS
    assert devices == pytest.approx(tf_devices.NUM_DEVICES)
