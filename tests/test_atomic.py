"""Saved files appear whole or not at all (`keras_parallel.persistence.atomic`)."""

import os

import keras
import numpy as np
import pytest
import resume_script

import keras_parallel
from keras_parallel.persistence import atomic


def test_replacing_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "model.keras"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic.replacing(path) as temporary:
            assert temporary.endswith("model.keras")  # Keras checks suffixes.
            with open(temporary, "w") as f:
                f.write("half of the new")
            raise KeyboardInterrupt
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["model.keras"]  # No temporary left.


def test_replacing_renames_what_was_written(tmp_path):
    path = tmp_path / "notes.json"
    atomic.write_text(path, "new")
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["notes.json"]


def test_nothing_written_replaces_nothing(tmp_path):
    path = tmp_path / "model.keras"
    path.write_text("old")
    with atomic.replacing(path):
        pass  # A process that does not write (not process 0).
    assert path.read_text() == "old"


def test_the_temporary_is_a_new_file_of_its_user_under_an_unguessable_name(
    tmp_path,
):
    # In a folder others can write to, a name known in advance could be a
    # symbolic link placed there to send the write elsewhere.
    names = []
    for _ in range(2):
        with atomic.replacing(tmp_path / "model.keras") as temporary:
            assert os.path.isfile(temporary) and not os.path.islink(temporary)
            assert os.stat(temporary).st_mode & 0o777 == 0o600
            assert str(os.getpid()) not in os.path.basename(temporary)
            names.append(temporary)
    assert names[0] != names[1]
    assert os.listdir(tmp_path) == []


def test_save_with_overwrite_false_writes_a_new_file(tmp_path):
    # The temporary exists before Keras writes it: Keras must not ask.
    model = resume_script.build()
    path = tmp_path / "model.weights.h5"
    model.save_weights(path, overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["model.weights.h5"]


def test_remote_paths_are_written_in_place():
    with atomic.replacing("gs://bucket/model.keras") as temporary:
        assert temporary == "gs://bucket/model.keras"


def _model():
    model = resume_script.build()
    model.fit(*resume_script.data(), batch_size=64, epochs=1, verbose=0)
    return model


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")
@pytest.mark.parametrize("method", ["save", "save_weights"])
def test_a_save_killed_half_way_leaves_the_previous_file(tmp_path, monkeypatch, method):
    model = _model()
    name = "model.keras" if method == "save" else "model.weights.h5"
    path = str(tmp_path / name)
    getattr(model, method)(path)
    before = open(path, "rb").read()
    expected = model.get_weights()
    model.get_layer("d1").kernel.assign(np.zeros((16, 32), "float32"))

    def dies_half_way(self, store, *args, **kwargs):
        store["0"] = np.zeros(3)  # Something written, then the kill.
        raise KeyboardInterrupt

    monkeypatch.setattr(keras.layers.Dense, "save_own_variables", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        getattr(model, method)(path)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == [name]
    if method == "save":
        loaded = keras.saving.load_model(
            path, custom_objects={"Net": resume_script.Net}
        )
    else:
        loaded = resume_script.build()  # Its optimizer unbuilt: not loaded.
        loaded.load_weights(path)
    for a, b in zip(loaded.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharding_callback_saves_whole_files_while_attached(tmp_path, monkeypatch):
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(8)(inputs))  # Not ours.
    model.compile(optimizer="sgd", loss="mse")
    callback = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    path = str(tmp_path / "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path)
    written = []
    replacing = atomic.replacing

    def recording(target):
        written.append(os.fspath(target))
        return replacing(target)

    monkeypatch.setattr(atomic, "replacing", recording)
    x, y = resume_script.data()
    model.fit(
        x, y, batch_size=64, epochs=1, verbose=0, callbacks=[callback, checkpoint]
    )
    assert written == [path]
    assert "save" not in model.__dict__  # Undone when the run ended.
    keras.saving.load_model(path)


def test_weights_of_another_model_are_refused_and_change_nothing(tmp_path):
    path = str(tmp_path / "model.weights.h5")
    resume_script.build().save_weights(path)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="d1")(inputs)
    # d1 fits the file, d2 does not: Keras would have loaded d1 already.
    other = resume_script.Net(inputs, keras.layers.Dense(4, name="d2")(x))
    other.compile(
        optimizer="adam",
        loss="mse",
        distribution=resume_script.keras_parallel.DataParallel(),
    )
    before = other.get_weights()
    with pytest.raises(ValueError, match="model.weights.h5") as error:
        other.load_weights(path)
    assert "the model is unchanged" in str(error.value)
    for a, b in zip(other.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_weights_file_is_named(tmp_path):
    path = tmp_path / "model.weights.h5"
    path.write_bytes(b"not a weights file")
    with pytest.raises(OSError, match="model.weights.h5"):
        resume_script.build().load_weights(str(path))
