"""describe(): the sharding plan as a text table."""

import keras
import pytest
from builders import dense_model

import keras_parallel
from keras_parallel.plan import resolve_plan
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
