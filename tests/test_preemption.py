"""Preemption in one process, on every backend: a signal mid-`fit` stops it
at that step with a backup and exit code 75, and the same call resumes to
the uninterrupted run's weights (`persistence/preemption.py`)."""

import json
import os
import signal
import threading
import time

import keras
import numpy as np
import pytest
import resume_script

from keras_parallel.persistence import backup, preemption

# TensorFlow in one process shuffles with its own random ops, which are not
# in the backup (docs/checkpoints.md): resumed exactly without a shuffle.
SHUFFLE = keras.backend.backend() != "tensorflow"


class SignalAt(keras.callbacks.Callback):
    """Sends `number` to this process at the end of batch `at` of an epoch."""

    def __init__(self, at, number=signal.SIGTERM):
        super().__init__()
        self.at = at
        self.number = number
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), self.number)


def fit(model, callbacks=()):
    x, y = resume_script.data()
    return model.fit(
        x,
        y,
        batch_size=32,
        epochs=4,
        shuffle=SHUFFLE,
        verbose=0,
        callbacks=list(callbacks),
    )


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


@pytest.fixture(scope="module")
def uninterrupted():
    model = resume_script.build()
    fit(model)
    return weights(model)


def assert_same(actual, expected):
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_mid_epoch_stops_there_and_the_same_call_resumes(
    tmp_path, uninterrupted, number
):
    directory = str(tmp_path / "backup")
    before = signal.getsignal(number)
    with pytest.raises(preemption.Preempted) as stopped:
        fit(
            resume_script.build(),
            [keras.callbacks.BackupAndRestore(directory), SignalAt((2, 3), number)],
        )
    assert stopped.value.code == preemption.PREEMPTED_EXIT_CODE == 75
    assert (stopped.value.epoch, stopped.value.batch) == (2, 3)
    assert number.name in str(stopped.value)
    assert signal.getsignal(number) == before  # Handlers put back.
    # The backup was written at the signal's step (save_freq="epoch" would
    # have written the end of epoch 1 only), and not deleted.
    metadata = json.load(open(os.path.join(directory, "training_metadata.json")))
    assert metadata["epoch"] == 2
    assert metadata[backup.METADATA_KEY]["steps_done"] == 4
    model = resume_script.build()
    history = fit(model, [keras.callbacks.BackupAndRestore(directory)])
    assert len(history.history["loss"]) == 2  # The rest of epoch 2, and 3.
    assert_same(weights(model), uninterrupted)


def test_signal_at_an_epochs_last_batch_resumes_at_the_next(tmp_path, uninterrupted):
    directory = str(tmp_path / "backup")
    with pytest.raises(preemption.Preempted):
        fit(
            resume_script.build(),
            # 203 rows by 32: batches 0..6.
            [keras.callbacks.BackupAndRestore(directory), SignalAt((1, 6))],
        )
    metadata = json.load(open(os.path.join(directory, "training_metadata.json")))
    assert metadata["epoch"] == 2
    assert metadata[backup.METADATA_KEY]["steps_done"] == 0
    model = resume_script.build()
    history = fit(model, [keras.callbacks.BackupAndRestore(directory)])
    assert len(history.history["loss"]) == 2
    assert_same(weights(model), uninterrupted)


def test_without_a_backup_it_stops_and_says_nothing_was_saved():
    with pytest.raises(preemption.Preempted, match="nothing was saved") as stopped:
        fit(resume_script.build(), [SignalAt((0, 2))])
    assert stopped.value.backup_dir is None
    assert "BackupAndRestore" in str(stopped.value)


def test_the_grace_timer_ends_with_the_run(monkeypatch):
    # A stopped run must not be ended later by its own grace timer.
    monkeypatch.setenv("KERAS_PARALLEL_PREEMPTION_GRACE", "0.5")
    with pytest.raises(preemption.Preempted):
        fit(resume_script.build(), [SignalAt((0, 2))])
    time.sleep(1.5)  # Still alive: this test goes on.
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer)]


def test_signals_are_read_from_the_environment():
    read = preemption.preemption_signals
    assert read({}) == (signal.SIGTERM, signal.SIGUSR1)
    assert read({"KERAS_PARALLEL_PREEMPTION_SIGNALS": "usr2"}) == (signal.SIGUSR2,)
    assert read({"KERAS_PARALLEL_PREEMPTION_SIGNALS": "none"}) == ()
    with pytest.raises(ValueError, match="SIGBOGUS.*SIGTERM,SIGUSR1"):
        read({"KERAS_PARALLEL_PREEMPTION_SIGNALS": "SIGBOGUS"})


def test_turned_off_a_signal_keeps_its_own_meaning(monkeypatch):
    monkeypatch.setenv("KERAS_PARALLEL_PREEMPTION_SIGNALS", "SIGUSR2")
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        fit(resume_script.build(), [SignalAt((0, 2), signal.SIGUSR1)])
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [1]  # Not preempted: the script's own handler ran.
