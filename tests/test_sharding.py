"""`shard=`: which variables the plan splits over the batch axis, on any backend.

The meshes name devices as strings, which the plan only compares: no device
is used. The backends' tests (test_jax_sharding.py, test_torch_sharding.py)
prove the training.
"""

import warnings

import keras
import pytest
from builders import wide_mlp

import keras_parallel
from keras_parallel.errors import ShardingError, ShardingWarning
from keras_parallel.plan import sharding
from keras_parallel.plan.sharding_plan import resolve_plan

DEVICES = [f"cpu:{i}" for i in range(8)]


def compiled(model, optimizer="adam"):
    model.compile(optimizer=optimizer, loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def plan_of(distribution, model):
    return resolve_plan(distribution, model, available_devices=DEVICES)


def data_parallel(shard, **kwargs):
    return keras_parallel.DataParallel(devices=DEVICES, shard=shard, **kwargs)


def test_full_shards_large_variables_and_their_adam_slots():
    model = compiled(wide_mlp(keras.Model))
    plan = plan_of(data_parallel("full"), model)
    axes = plan.variable_axes()
    # The largest dimension the 8 devices divide.
    assert axes["d1/kernel"] == (None, "batch")
    assert axes["d2/kernel"] == ("batch", None)
    assert axes["d1/bias"] == (None,)  # 512 < 4096 elements: whole.
    slots = [v for v in plan.variables if v.kind == "optimizer" and v.shape]
    for slot in slots:
        reference = "d1/kernel" if "d1_kernel" in slot.path else None
        reference = reference or ("d2/kernel" if "d2_kernel" in slot.path else None)
        if reference:
            assert slot.axes == axes[reference], slot.path
            assert slot.bytes_per_device * 8 == slot.bytes_total
    kernel = {v.path: v for v in plan.variables}["d1/kernel"]
    assert kernel.bytes_per_device * 8 == kernel.bytes_total
    assert kernel.key == "(sharded)"
    assert plan.shard == "full"


def test_optimizer_shards_the_slots_only():
    model = compiled(wide_mlp(keras.Model))
    plan = plan_of(data_parallel("optimizer"), model)
    entries = {v.path: v for v in plan.variables}
    assert entries["d1/kernel"].axes == (None, None)
    momentum = [e for p, e in entries.items() if "d1_kernel_momentum" in p]
    assert momentum and momentum[0].axes == (None, "batch")
    assert momentum[0].key == "(follows d1/kernel, sharded)"
    # The iteration counter and the learning rate stay whole.
    assert all(
        e.axes == (None,) * len(e.shape)
        for e in entries.values()
        if e.kind == "optimizer" and "d1" not in e.path and "d2" not in e.path
    )


def test_none_is_plain_data_parallelism():
    model = compiled(wide_mlp(keras.Model))
    plan = plan_of(data_parallel(None), model)
    assert plan.bytes_per_device() == plan.bytes_total()
    assert plan.shard is None


def test_shard_min_size_keeps_small_variables_whole():
    model = compiled(wide_mlp(keras.Model))
    axes = plan_of(data_parallel("full", shard_min_size=10_000), model)
    axes = axes.variable_axes()
    assert axes["d1/kernel"] == (None, "batch")
    assert axes["d2/kernel"] == (None, None)  # 8192 < 10000.
    every = plan_of(data_parallel("full", shard_min_size=1), model)
    assert every.variable_axes()["d1/bias"] == ("batch",)


def test_integer_variables_are_never_sharded():
    model = compiled(wide_mlp(keras.Model))
    plan = plan_of(data_parallel("full", shard_min_size=1), model)
    for entry in plan.variables:
        if not sharding.is_floating(entry.dtype):
            assert set(entry.axes) <= {None}, entry.path


def test_a_variable_no_dimension_of_which_divides_warns_and_stays_whole():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((100,))
    outputs = keras.layers.Dense(50, name="odd")(inputs)
    model = compiled(keras.Model(inputs, outputs))
    with pytest.warns(ShardingWarning, match=r"'odd/kernel' \(shape \(100, 50\)\)"):
        plan = plan_of(data_parallel("full"), model)
    assert plan.variable_axes()["odd/kernel"] == (None, None)


def test_model_parallel_full_adds_the_batch_axis_to_a_free_dimension():
    model = compiled(wide_mlp(keras.Model))
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], DEVICES)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    distribution = keras_parallel.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch", shard="full"
    )
    plan = plan_of(distribution, model)
    entries = {v.path: v for v in plan.variables}
    # Split over both axes: 1/8 per device.
    assert entries["d1/kernel"].axes == ("batch", "model")
    assert entries["d1/kernel"].key == "d1/kernel (+ sharded)"
    assert entries["d1/kernel"].bytes_per_device * 8 == entries["d1/kernel"].bytes_total
    # Not in the map: split over the batch axis (4 devices) alone.
    assert entries["d2/kernel"].axes == ("batch", None)


def test_bad_shard_is_refused_before_anything():
    with pytest.raises(ShardingError, match=r"Received: shard='bogus'"):
        data_parallel("bogus")
    for size in (0, -3, 2.5, True):
        with pytest.raises(ShardingError, match="shard_min_size"):
            data_parallel("full", shard_min_size=size)


def test_describe_names_what_is_sharded_and_the_bytes_per_device():
    big = compiled(wide_mlp(keras.Model))
    distribution = data_parallel("full")
    plan = plan_of(distribution, big)
    from keras_parallel.report import format_plan

    table = format_plan(plan, big.name)
    assert "shard='full'" in table
    assert "(sharded)" in table
    assert plan.bytes_per_device() < plan.bytes_total() / 4


def test_get_variable_layout_shards_a_variable_made_in_scope():
    distribution = data_parallel("full")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)
        variable = keras.Variable(keras.ops.zeros((64, 256)), name="w", trainable=True)
    layout = distribution.get_variable_layout(variable)
    assert tuple(layout.axes) == (None, "batch")
    small = keras.Variable(keras.ops.zeros((8,)), name="b")
    assert tuple(distribution.get_variable_layout(small).axes) == (None,)
