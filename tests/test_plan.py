"""resolve_plan: layouts and validation, on any backend (no device is used).

The meshes name devices as strings, which the plan only compares; no
backend array is made.
"""

import keras
import numpy as np
import pytest
from builders import dense_model

from keras_parallel.errors import ShardingError, UnmatchedLayoutKeyWarning
from keras_parallel.plan.sharding_plan import resolve_plan

DEVICES = [f"cpu:{i}" for i in range(8)]


@pytest.fixture
def model():
    model = dense_model(keras.Model, batchnorm=True)
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def mesh(shape=(4, 2), names=("data", "model"), devices=DEVICES):
    return keras.distribution.DeviceMesh(shape, list(names), devices=devices)


def model_parallel(entries, shape=(4, 2), batch_dim_name="data"):
    layout_map = keras.distribution.LayoutMap(mesh(shape))
    for key, axes in entries.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=batch_dim_name
    )


def resolve(distribution, model):
    return resolve_plan(distribution, model, available_devices=DEVICES)


def test_data_parallel_replicates_every_variable(model):
    distribution = keras.distribution.DataParallel(devices=DEVICES)
    plan = resolve(distribution, model)
    assert plan.data_parallel_size == 8
    assert plan.batch_axis == "batch"
    assert all(set(v.axes) <= {None} for v in plan.variables)
    kinds = {v.kind for v in plan.variables}
    assert kinds == {"model", "optimizer", "metric"}
    assert plan.bytes_per_device() == plan.bytes_total()


def test_model_parallel_layouts_and_optimizer_slots(model):
    plan = resolve(
        model_parallel({"d1/kernel": (None, "model"), "d1/bias": ("model",)}), model
    )
    axes = plan.variable_axes()
    assert axes["d1/kernel"] == (None, "model")
    assert axes["d1/bias"] == ("model",)
    assert axes["d2/kernel"] == (None, None)
    slots = [
        v for v in plan.variables if v.kind == "optimizer" and "d1_kernel" in v.path
    ]
    assert [v.axes for v in slots] == [(None, "model")] * 2
    assert all(v.key == "(follows d1/kernel)" for v in slots)
    kernel = next(v for v in plan.variables if v.path == "d1/kernel")
    assert kernel.bytes_per_device == kernel.bytes_total // 2


def test_regex_key_matches_many_variables(model):
    plan = resolve(model_parallel({"d./kernel": (None, None)}), model)
    assert [v.key for v in plan.variables if v.path.endswith("kernel")] == [
        "d./kernel"
    ] * 2


def test_exact_key_wins_over_regex(model):
    plan = resolve(
        model_parallel({"d1/kernel": (None, "model"), "d.*kernel": (None, None)}), model
    )
    assert plan.variable_axes()["d1/kernel"] == (None, "model")


def test_output_key_resolves_to_layer_path(model):
    plan = resolve(model_parallel({"d2/output": ("data", None)}), model)
    assert [(o.key, o.path, o.axes) for o in plan.outputs] == [
        ("d2/output", "d2/output", ("data", None))
    ]
    assert plan.output_axes("outer/d2/output") == ("data", None)
    assert plan.output_axes("d1/output") is None


# ---------------------------------------------------------- bad input


def test_more_devices_than_exist(model):
    devices = [f"cpu:{i}" for i in range(16)]
    distribution = keras.distribution.DataParallel(devices=devices)
    with pytest.raises(ShardingError, match="asks for 16 devices, but only 8 exist"):
        resolve(distribution, model)


def test_devices_that_do_not_exist(model):
    devices = [f"gpu:{i}" for i in range(8)]
    distribution = keras.distribution.DataParallel(devices=devices)
    with pytest.raises(ShardingError, match="names devices that do not exist"):
        resolve(distribution, model)


def test_mesh_shape_that_does_not_fit_its_devices():
    # Keras's DeviceMesh refuses this itself, before keras_parallel sees it.
    with pytest.raises(ValueError, match="Shape does not match the number of devices"):
        mesh(shape=(3, 2))


def test_layout_axis_not_in_mesh(model):
    other = keras.distribution.DeviceMesh((8,), ["shard"], devices=DEVICES)
    layout_map = keras.distribution.LayoutMap(mesh())
    layout_map["d1/kernel"] = keras.distribution.TensorLayout((None, "shard"), other)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    with pytest.raises(
        ShardingError, match="'d1/kernel' names a layout axis that is not a mesh axis"
    ):
        resolve(distribution, model)


def test_layout_rank_differs_from_variable_rank(model):
    with pytest.raises(
        ShardingError, match="has rank 1, but variable 'd1/kernel' has rank 2"
    ):
        resolve(model_parallel({"d1/kernel": ("model",)}), model)


def test_dimension_not_divisible_by_mesh_axis(model):
    # A (16, 6) kernel: 6 columns do not split 8 ways.
    with pytest.raises(
        ShardingError, match="'d2/kernel' cannot be split over mesh axis 'model'"
    ):
        resolve(
            model_parallel({"d2/kernel": (None, "model")}, shape=(1, 8)), _odd_model()
        )


def _odd_model():
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(6, name="d2")(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_variable_matched_by_two_keys(model):
    with pytest.raises(
        ShardingError, match="'d1/kernel' is matched by 2 LayoutMap keys"
    ):
        resolve(
            model_parallel({"d1/.*": (None, "model"), ".*/kernel": (None, None)}), model
        )


def test_output_suffix_matching_two_layers():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d2 = keras.layers.Dense(8, name="d2")

        def call(self, x):
            return self.d2(x)

    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Block(name="block")
            self.head = keras.layers.Dense(8, name="d2")

        def call(self, x):
            return self.head(self.block(x))

    model = Net(name="net")
    model(np.zeros((2, 16), "float32"))
    with pytest.raises(
        ShardingError, match="'d2/output' matches 2 layers by path suffix"
    ):
        resolve(model_parallel({"d2/output": ("data", None)}), model)
    # The full path names one of them.
    plan = resolve(model_parallel({"net/block/d2/output": ("data", None)}), model)
    assert [o.path for o in plan.outputs] == ["net/block/d2/output"]


def test_batch_dim_name_not_in_mesh(model):
    with pytest.raises(ShardingError, match="batch_dim_name='rows'"):
        resolve(model_parallel({}, batch_dim_name="rows"), model)


def test_unmatched_key_warns_with_closest_paths(model):
    with pytest.warns(UnmatchedLayoutKeyWarning, match=r"'d1/kernal'.*'d1/kernel'"):
        resolve(model_parallel({"d1/kernal": (None, "model")}), model)
