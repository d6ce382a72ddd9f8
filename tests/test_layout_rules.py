"""Rules placing logical axes on mesh axes, and `ModelParallel(rules=...)`."""

import keras
import pytest

import keras_parallel
from keras_parallel.errors import ShardingError
from keras_parallel.plan import layout_rules
from keras_parallel.plan.logical_axes import LogicalAxes

SIZES = {"data": 2, "model": 4}
AUTO = layout_rules.auto_rules(("data", "model"), "data")


def place(names, shape, rules=AUTO):
    return layout_rules.place(LogicalAxes(names, "test"), shape, rules, SIZES)


def test_the_first_rule_that_fits_wins():
    axes, note, misfits = place(("embed", "mlp"), (16, 64))
    assert axes == (None, "model")
    assert note == "(rules: mlp->model)"
    assert misfits == []


def test_a_dimension_the_axis_does_not_divide_falls_to_the_next_rule_or_stays_whole():
    # Two key/value heads on a model axis of 4: whole, and the plan says so.
    axes, note, misfits = place(("embed", "kv_heads", "kv_head_dim"), (32, 2, 8))
    assert axes == (None, None, None)
    assert "model does not divide kv_heads 2" in note
    assert misfits == [("kv_heads", "model", 2)]
    rules = AUTO + (("kv_head_dim", "model"),)
    axes, _, _ = place(("embed", "kv_heads", "kv_head_dim"), (32, 2, 8), rules)
    assert axes == (None, None, "model")


def test_a_mesh_axis_splits_one_dimension_of_a_variable():
    rules = (("embed", "model"), ("mlp", "model"), ("mlp", "data"))
    axes, _, _ = place(("embed", "mlp"), (16, 64), rules)
    assert axes == ("model", "data")


def test_a_rule_to_none_keeps_the_dimension_whole():
    rules = (("mlp", None), ("mlp", "model"))
    axes, _, _ = place(("embed", "mlp"), (16, 64), rules)
    assert axes == (None, None)


def test_unknown_layers_stay_whole():
    axes, note, _ = layout_rules.place(None, (3, 4), AUTO, SIZES)
    assert axes == (None, None)
    assert note == "(no logical axes)"


def test_auto_rules_need_one_model_axis():
    with pytest.raises(ShardingError, match="two axes, the batch axis and one"):
        layout_rules.auto_rules(("data", "model", "expert"), "data")
    with pytest.raises(ShardingError, match="two axes"):
        layout_rules.auto_rules(("data",), "data")


@pytest.mark.parametrize(
    "rules, match",
    [
        ("fast", 'must be "auto" or a list'),
        ([("mlp",)], r"Received: \('mlp',\)"),
        ([("mlp", 4)], "the mesh axis a string or None"),
        ([["mlp", ("model", "data")]], "pair of names"),
        (5, r"Received: rules=5;"),
        (
            ("mlp", "model"),
            r"Received: rules=\('mlp', 'model'\); .*a list, even of one",
        ),
        ({"mlp": "model"}, r"Received: rules=\{'mlp': 'model'\}"),
    ],
)
def test_rules_that_are_not_pairs_of_names_are_refused(rules, match):
    with pytest.raises(ShardingError, match=match):
        layout_rules.check_rules(rules)


def mesh(shape=(1, 1)):
    devices = keras.distribution.list_devices()[: shape[0] * shape[1]]
    return keras.distribution.DeviceMesh(shape, ["data", "model"], devices)


def test_a_rule_naming_an_axis_the_mesh_lacks_is_refused_when_made():
    with pytest.raises(
        ShardingError, match=r"Rule \('mlp', 'tensor'\) names a mesh axis"
    ):
        keras_parallel.ModelParallel(
            device_mesh=mesh(), rules=[("mlp", "tensor")], batch_dim_name="data"
        )


def test_auto_rules_on_a_mesh_of_three_axes_are_refused_when_made():
    devices = keras.distribution.list_devices()[:1]
    three = keras.distribution.DeviceMesh((1, 1, 1), ["data", "model", "x"], devices)
    with pytest.raises(ShardingError, match="two axes, the batch axis and one"):
        keras_parallel.ModelParallel(
            device_mesh=three, rules="auto", batch_dim_name="data"
        )


def test_model_parallel_needs_a_layout_map_or_rules_with_a_mesh():
    with pytest.raises(ShardingError, match="needs a layout_map, or rules"):
        keras_parallel.ModelParallel(device_mesh=mesh(), batch_dim_name="data")
    with pytest.raises(ShardingError, match="needs a layout_map, or rules"):
        keras_parallel.ModelParallel(rules="auto", batch_dim_name="data")
    other = keras.distribution.LayoutMap(mesh())
    with pytest.raises(ShardingError, match="a layout_map of another mesh"):
        keras_parallel.ModelParallel(
            device_mesh=mesh(), layout_map=other, rules="auto", batch_dim_name="data"
        )


def mlp():
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(16, name="down")(h), name="mlp")


def test_a_rule_that_splits_nothing_warns_naming_it():
    distribution = keras_parallel.ModelParallel(
        device_mesh=mesh(),
        rules=[("mlp", "model"), ("vocab", "model")],
        batch_dim_name="data",
    )
    with pytest.warns(
        UserWarning,
        match=r"Rule \('vocab', 'model'\) splits nothing: no variable of model 'mlp' has logical axis 'vocab'",
    ):
        keras_parallel.describe(mlp(), distribution)
