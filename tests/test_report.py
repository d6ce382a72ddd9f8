"""describe(): the sharding plan as a text table."""

import keras
import pytest
from builders import dense_model

import keras_parallel
from keras_parallel.plan.sharding_plan import resolve_plan
from keras_parallel.report import format_plan

DEVICES = [f"cpu:{i}" for i in range(8)]


def test_table_lists_mesh_variables_outputs_and_bytes():
    model = dense_model(keras.Model)
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"], devices=DEVICES)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d2/output"] = ("data", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    text = format_plan(resolve_plan(distribution, model), model.name)
    assert "Mesh: data=1, model=8 (8 devices: cpu:0" in text
    lines = text.splitlines()
    kernel = next(line for line in lines if line.startswith("d1/kernel"))
    # (16, 32) float32 = 2 KiB, split 8 ways = 256 B per device.
    assert "(16, 32)" in kernel and "float32" in kernel and "(-, model)" in kernel
    assert "256 B" in kernel
    slot = next(line for line in lines if "d1_kernel_momentum" in line)
    assert "optimizer" in slot and "256 B" in slot and "(follows d1/kernel)" in slot
    assert any(line.startswith("loss/total") and "metric" in line for line in lines)
    assert "d2/output  (data, -)" in text
    assert "Model + optimizer variables per device:" in text


def test_describe_needs_a_distribution_and_a_built_model():
    model = dense_model(keras.Model)
    with pytest.raises(ValueError, match="has no distribution to describe"):
        keras_parallel.describe(model)

    class Lazy(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(ValueError, match="is not built"):
        keras_parallel.describe(
            Lazy(), keras.distribution.DataParallel(devices=DEVICES[:1])
        )


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX devices")
def test_describe_a_model_with_a_given_distribution():
    model = dense_model(keras.Model)
    text = keras_parallel.describe(model, keras_parallel.DataParallel())
    assert "Batch: split 8 ways along 'batch'" in text
    assert "d2/bias" in text


# ------------------------------------------------------------- one device
#: What each backend's hint must name to get more than one device.
MORE_DEVICES = {
    "jax": "XLA_FLAGS=--xla_force_host_platform_device_count=8",
    "torch": "keras-parallel launch --nproc 2",
    "tensorflow": "keras_parallel.split_cpu(8)",
}


def _one_device():
    from keras_parallel.backends import executor_class

    devices = executor_class().list_devices()[:1]
    return keras.distribution.DataParallel(devices=devices)


def test_one_device_and_one_process_are_singular(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", keras.backend.backend())
    model = dense_model(keras.Model)
    distribution = _one_device()
    text = format_plan(resolve_plan(distribution, model), model.name)
    assert f"Backend: {keras.backend.backend()}, 1 device in 1 process\n" in text
    assert "(1 device: " in text
    assert "Batch: not split" in text


def test_backend_note_says_where_an_unchosen_backend_came_from(monkeypatch, tmp_path):
    from keras_parallel.report import backend_note

    monkeypatch.setenv("KERAS_BACKEND", "jax")
    assert backend_note("jax") is None  # Chosen: nothing to explain.
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setenv("KERAS_BACKEND", "")  # Keras ignores it empty.
    note = backend_note("tensorflow")
    assert "Keras runs 'tensorflow' (from Keras's default" in note
    monkeypatch.delenv("KERAS_BACKEND")
    (tmp_path / "keras.json").write_text('{"backend": "jax"}')
    note = backend_note("jax")
    assert f"Keras runs 'jax' (from {tmp_path / 'keras.json'})" in note


def test_one_device_hint_says_how_to_get_more_devices(monkeypatch):
    from keras_parallel.backends import executor_class
    from keras_parallel.report import one_device_hint

    model = dense_model(keras.Model)
    distribution = _one_device()
    executor = executor_class()(distribution)
    plan = resolve_plan(distribution, model)
    # A backend that sees one device: the backend's own remedy.
    monkeypatch.setattr(type(executor), "list_devices", classmethod(lambda c: ["x"]))
    monkeypatch.setenv("KERAS_BACKEND", keras.backend.backend())
    hint = one_device_hint(plan, executor)
    assert "DataParallel runs on one device" in hint
    assert MORE_DEVICES[keras.backend.backend()] in hint
    assert "KERAS_BACKEND" not in hint
    # One that sees more: the distribution should name them all.
    monkeypatch.setattr(
        type(executor), "list_devices", classmethod(lambda c: ["a", "b", "c"])
    )
    monkeypatch.delenv("KERAS_BACKEND")
    hint = one_device_hint(plan, executor)
    assert "sees 3 devices: give the distribution's mesh more" in hint
    assert "KERAS_BACKEND is not set" in hint
    wide = resolve_plan(keras.distribution.DataParallel(devices=DEVICES[:2]), model)
    assert one_device_hint(wide, executor) is None


def test_fit_on_one_device_prints_the_hint_once_even_when_quiet(capsys):
    import numpy as np

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    x = np.ones((8, 16), "float32")
    y = np.ones((8, 8), "float32")
    model = dense_model(Net)
    # Adam's slots, built by fit, make a second plan: still one hint.
    model.compile(optimizer="adam", loss="mse", distribution=_one_device())
    model.fit(x, y, batch_size=4, verbose=0)
    model.fit(x, y, batch_size=4, verbose=0)
    out = capsys.readouterr().out
    assert out.count("DataParallel runs on one device") == 1, out
