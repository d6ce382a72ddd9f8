"""`keras.callbacks.BackupAndRestore` under keras_parallel: exact, atomic, checked.

In one process on every backend (the SIGKILL runs across processes are in
`test_backup_processes.py`): an interrupted `fit` started again ends with
the uninterrupted run's weights; a save interrupted half way leaves the
previous backup, which resumes; another model's or a damaged backup is
refused with an error naming the file, and nothing is overwritten.
"""

import json
import os

import keras
import numpy as np
import pytest
import resume_script

import keras_parallel
from keras_parallel.persistence import backup

BACKEND = keras.backend.backend()
# The files and their checks are the same on every backend: TensorFlow (the
# slowest to run) checks the resume and the refusal only.
not_tensorflow = pytest.mark.skipif(
    BACKEND == "tensorflow", reason="backend-neutral; run on JAX and torch"
)
# TensorFlow shuffles with its own random ops (tf.data), whose state is not
# part of the backup: resumed exactly without a shuffle only.
SHUFFLE = BACKEND != "tensorflow"


class Interrupt(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def fit(model, callbacks=(), **kwargs):
    x, y = resume_script.data()
    options = dict(batch_size=32, epochs=4, shuffle=SHUFFLE, verbose=0)
    options.update(kwargs)
    return model.fit(x, y, callbacks=list(callbacks), **options)


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


@pytest.fixture(scope="module")
def uninterrupted():
    model = resume_script.build()
    fit(model)
    return weights(model)


def assert_same(actual, expected):
    assert expected, "no weights to compare"
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_interrupted_fit_resumes_with_the_uninterrupted_weights(
    tmp_path, uninterrupted
):
    directory = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            resume_script.build(),
            [keras.callbacks.BackupAndRestore(directory), Interrupt((2, 3))],
        )
    metadata = json.load(open(os.path.join(directory, "training_metadata.json")))
    assert metadata["epoch"] == 2
    model = resume_script.build()
    history = fit(model, [keras.callbacks.BackupAndRestore(directory)])
    assert len(history.history["loss"]) == 2  # Epochs 2 and 3 only.
    assert_same(weights(model), uninterrupted)


@not_tensorflow
def test_save_interrupted_half_way_leaves_the_previous_backup(
    tmp_path, monkeypatch, uninterrupted
):
    directory = str(tmp_path / "backup")
    commits = []
    write_text = backup.atomic.write_text

    def dies_at_the_second_commit(path, text):
        commits.append(path)
        if len(commits) == 2:
            raise KeyboardInterrupt("killed while saving")
        write_text(path, text)

    monkeypatch.setattr(backup.atomic, "write_text", dies_at_the_second_commit)
    with pytest.raises(KeyboardInterrupt):
        fit(resume_script.build(), [keras.callbacks.BackupAndRestore(directory)])
    monkeypatch.undo()
    # The second epoch's weights were written, never committed.
    assert sorted(os.listdir(directory)) == [
        "training_metadata.json",
        "weights-1.weights.h5",
        "weights-2.weights.h5",
    ]
    model = resume_script.build()
    history = fit(model, [keras.callbacks.BackupAndRestore(directory)])
    assert len(history.history["loss"]) == 3  # Resumed after epoch 0.
    assert_same(weights(model), uninterrupted)


@pytest.mark.filterwarnings("ignore:Skipping nested container")
def test_backup_of_another_model_is_refused_and_kept(tmp_path):
    directory = str(tmp_path / "backup")
    with pytest.raises(RuntimeError):
        fit(
            resume_script.build(),
            [keras.callbacks.BackupAndRestore(directory), Interrupt((1, 0))],
        )
    before = {
        name: open(os.path.join(directory, name), "rb").read()
        for name in os.listdir(directory)
    }
    other = _other_model()
    initial = weights(other)
    with pytest.raises(backup.BackupError, match="weights-1.weights.h5") as error:
        fit(other, [keras.callbacks.BackupAndRestore(directory)])
    message = str(error.value)
    assert "delete the backup folder" in message
    # One account of the failure, not `load_weights`'s own wrapped inside it
    # (its file, fix and "Received:" said twice).
    assert message.count("cannot be loaded into") == 1, message
    assert message.count("Received:") <= 1, message
    after = {
        name: open(os.path.join(directory, name), "rb").read()
        for name in os.listdir(directory)
    }
    assert after == before
    assert_same(weights(other), initial)


@not_tensorflow
def test_damaged_backup_is_named_or_falls_back_to_the_previous(tmp_path, uninterrupted):
    directory = str(tmp_path / "backup")
    with pytest.raises(RuntimeError):
        fit(
            resume_script.build(),
            [
                keras.callbacks.BackupAndRestore(directory, double_checkpoint=True),
                Interrupt((2, 3)),
            ],
        )
    assert sorted(os.listdir(directory)) == [
        "training_metadata.json",
        "training_metadata.json.bkp",
        "weights-1.weights.h5",
        "weights-2.weights.h5",
    ]
    latest = os.path.join(directory, "weights-2.weights.h5")
    with open(latest, "r+b") as f:
        f.truncate(os.path.getsize(latest) // 2)
    with pytest.raises(backup.BackupError, match="weights-2.weights.h5"):
        fit(resume_script.build(), [keras.callbacks.BackupAndRestore(directory)])
    # With the previous backup kept, it resumes from that one (epoch 1).
    model = resume_script.build()
    history = fit(
        model, [keras.callbacks.BackupAndRestore(directory, double_checkpoint=True)]
    )
    assert len(history.history["loss"]) == 3
    assert_same(weights(model), uninterrupted)


@pytest.mark.skipif(
    BACKEND == "torch", reason="one device per process: ranks in test_faults"
)
def test_a_backup_resumes_on_half_the_devices_as_the_uninterrupted_run(
    tmp_path, uninterrupted, capsys
):
    # Interrupted mid-epoch on every device (8 on JAX; TensorFlow's 4
    # logical devices), resumed on half of them: the same global batches,
    # split otherwise, end with the uninterrupted run's weights on the
    # first devices (to the rounding of sums split otherwise), and the run
    # says where it resumed. TensorFlow's replicas draw a Dropout mask each,
    # so its masks change with the number of replicas (docs/checkpoints.md):
    # its model has none.
    from split_probe import assert_divided, clear, records

    dropout = BACKEND != "tensorflow"
    devices = keras.distribution.list_devices()
    fewer = devices[: len(devices) // 2]
    expected = uninterrupted
    if not dropout:
        reference = resume_script.build(devices=devices, dropout=False)
        fit(reference)
        expected = weights(reference)
    directory = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            resume_script.build(devices=devices, dropout=dropout),
            [
                keras.callbacks.BackupAndRestore(directory, save_freq=2),
                Interrupt((2, 3)),
            ],
        )
    capsys.readouterr()
    model = resume_script.build(probe=True, devices=fewer, dropout=dropout)
    clear()
    fit(model, [keras.callbacks.BackupAndRestore(directory, save_freq=2)])
    assert_divided(records(), 32, len(fewer))
    for a, b in zip(weights(model), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert (
        f"keras_parallel: resumed in epoch 3 after 4 batches, from a backup made "
        f"on {len(devices)} devices in 1 process; now {len(fewer)} devices in 1 "
        "process"
    ) in capsys.readouterr().out


@pytest.mark.parametrize("door", ["model", "callback"])
def test_mid_epoch_backup_resumes_after_the_batches_it_trained(
    tmp_path, uninterrupted, door
):
    # Saved every 2 batches; interrupted right after the save at epoch 2,
    # batch 3: 4 batches of that epoch trained, with their shuffle (not on
    # TensorFlow) and dropout masks. Both doors resume alike: the callback
    # door is handed the model after Keras made its training iterator.
    directory = str(tmp_path / "backup")

    def build_and_door():
        if door == "model":
            return resume_script.build(), []
        sharding = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
        return resume_script.build(distributed=False), [sharding]

    model, doors = build_and_door()
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            model,
            [
                *doors,
                keras.callbacks.BackupAndRestore(directory, save_freq=2),
                Interrupt((2, 3)),
            ],
        )
    for sharding in doors:
        sharding.close()  # Keras calls no callback when fit raises.
    metadata = json.load(open(os.path.join(directory, "training_metadata.json")))
    assert metadata["epoch"] == 2
    assert metadata[backup.METADATA_KEY]["steps_done"] == 4
    model, doors = build_and_door()
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append(batch)
    )
    history = fit(
        model,
        [*doors, keras.callbacks.BackupAndRestore(directory, save_freq=2), record],
    )
    assert len(history.history["loss"]) == 2  # Epochs 2 (its rest) and 3.
    assert seen[:3] == [4, 5, 6]  # 7 batches an epoch (203 rows by 32).
    assert len(seen) == 3 + 7  # 10 batches trained, 17 as Keras resumes.
    assert_same(weights(model), uninterrupted)


def backup_after_six_batches(tmp_path):
    """A backup saved every 2 batches, interrupted at epoch 2, batch 5 (6
    batches of 32 trained in it); returns its folder."""
    directory = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            resume_script.build(),
            [
                keras.callbacks.BackupAndRestore(directory, save_freq=2),
                Interrupt((2, 5)),
            ],
        )
    return directory


@pytest.mark.parametrize("batch_size", [64, 16])
def test_mid_epoch_backup_refuses_another_batch_size(tmp_path, batch_size):
    # Made with batches of 32 (7 an epoch), resumed with 64 (4) or 16 (13):
    # refused before anything is loaded, the model left as it was.
    directory = backup_after_six_batches(tmp_path)
    model = resume_script.build()
    before = weights(model)
    batches = -(-203 // batch_size)
    with pytest.raises(
        backup.BackupError,
        match=f"made with 7 batches an epoch, and this run has {batches}",
    ):
        fit(
            model,
            [keras.callbacks.BackupAndRestore(directory, save_freq=2)],
            batch_size=batch_size,
        )
    for a, b in zip(weights(model), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_backup_folder_is_its_users_alone(tmp_path, monkeypatch):
    # Made readable by its user only; one another user owns (a shared
    # /tmp) is refused before anything is read, the model as it was.
    directory = backup_after_six_batches(tmp_path)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    model = resume_script.build()
    before = weights(model)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(directory).st_uid + 1)
    with pytest.raises(backup.BackupError, match="belongs to another user"):
        fit(model, [keras.callbacks.BackupAndRestore(directory)])
    for a, b in zip(weights(model), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["../../weights-1.weights.h5", "/etc/passwd", 7])
def test_metadata_naming_another_file_is_refused(tmp_path, name):
    directory = backup_after_six_batches(tmp_path)
    path = os.path.join(directory, "training_metadata.json")
    metadata = json.load(open(path))
    metadata[backup.METADATA_KEY]["weights"] = name
    with open(path, "w") as f:
        json.dump(metadata, f)
    with pytest.raises(backup.BackupError, match="not a name a backup writes"):
        fit(resume_script.build(), [keras.callbacks.BackupAndRestore(directory)])


def test_mid_epoch_backup_refuses_a_generator_that_runs_short(tmp_path):
    # A generator has no length to compare: refused when it ends before the
    # batches the backup had trained (6 here; it gives 4).
    directory = backup_after_six_batches(tmp_path)
    x, y = resume_script.data()
    four = ((x[i : i + 32], y[i : i + 32]) for i in range(0, 128, 32))
    with pytest.raises(backup.BackupError, match="after 6 batches of its epoch"):
        resume_script.build().fit(
            four,
            epochs=4,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(directory, save_freq=2)],
        )


@not_tensorflow
def test_mid_epoch_backup_of_a_resumed_run_names_its_epoch(tmp_path):
    directory = str(tmp_path / "backup")
    with pytest.raises(RuntimeError):
        fit(
            resume_script.build(),
            [keras.callbacks.BackupAndRestore(directory), Interrupt((2, 0))],
        )
    with pytest.raises(RuntimeError):
        fit(
            resume_script.build(),
            [
                keras.callbacks.BackupAndRestore(directory, save_freq=2),
                Interrupt((2, 3)),
            ],
        )
    metadata = json.load(open(os.path.join(directory, "training_metadata.json")))
    # Keras's own counter said 0 here (it moves at epoch ends only).
    assert (metadata["epoch"], metadata["batch"]) == (2, 3)


@not_tensorflow
def test_plain_keras_backup_is_left_alone(tmp_path):
    """A model without a distribution keeps Keras's own callback."""
    directory = str(tmp_path / "backup")
    model = resume_script.build(distributed=False)
    with pytest.raises(RuntimeError):
        fit(model, [keras.callbacks.BackupAndRestore(directory), Interrupt((1, 0))])
    assert sorted(os.listdir(directory)) == [
        "latest.weights.h5",
        "training_metadata.json",
    ]


def _other_model():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(12, activation="relu", name="d1")(inputs)
    x = keras.layers.Dropout(0.3, seed=3)(x)
    model = resume_script.Net(inputs, keras.layers.Dense(8, name="d2")(x))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        distribution=resume_script.keras_parallel.DataParallel(),
    )
    return model
