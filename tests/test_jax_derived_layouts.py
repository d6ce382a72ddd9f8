"""`ModelParallel(rules="auto")` on JAX: no LayoutMap written, exact, split.

Each case trains one step on a `(data=2, model=4)` mesh of 8 simulated
devices and compares it with one device from the same weights (1e-5). The
split is proven twice: the rows one device computed (`split_probe`, inside
the compiled step) and the shard each device holds of every variable the
plan splits. Against KerasHub's own `get_layout_map` the compiled step's
collectives and the bytes a device holds are compared, read from the
optimized HLO.
"""

import re

import hub_models
import keras
import numpy as np
import pytest
import split_probe
from builders import max_relative_difference

import keras_parallel

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX executor tests; run them under tox -e jax",
)

BATCH = 8
# max_relative_difference's `noise_floor` is for the attention's key bias:
# its gradient is zero in exact arithmetic, so it holds rounding noise only.


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def mesh():
    return keras.distribution.DeviceMesh(
        (2, 4), ["data", "model"], keras.distribution.list_devices()
    )


def auto(**kwargs):
    return keras_parallel.ModelParallel(
        device_mesh=mesh(), rules="auto", batch_dim_name="data", **kwargs
    )


def train(model, data, distribution=None, door="callback"):
    x, y = data
    kwargs, callbacks = {}, []
    if distribution is not None and door == "compile":
        kwargs["distribution"] = distribution
    elif distribution is not None:
        callbacks = [keras_parallel.ShardingCallback(distribution)]
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **kwargs)
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
    )
    return [np.array(v.value) for v in model.weights]


def one_device(build, data):
    weights = train(build(), data)
    split_probe.clear()
    return weights


def shards(model):
    """`{path: (shard shape, whole shape)}` as device 0 holds them."""
    return {
        v.path: (
            tuple(v.value.addressable_shards[0].data.shape),
            tuple(v.value.shape),
        )
        for v in model.weights
    }


def device_bytes(model):
    return sum(v.value.addressable_shards[0].data.nbytes for v in model.weights)


def assert_held_as_planned(model, distribution):
    """Every variable is split as the plan says, and the plan splits the large ones."""
    plan = keras_parallel.describe(model, distribution)
    held = shards(model)
    split, whole = 0, 0
    for variable in model.weights:
        shard, shape = held[variable.path]
        size = int(np.prod(shape)) * variable.value.dtype.itemsize
        if shard == shape:
            whole += size
        else:
            split += size
    assert split, plan
    # A quarter of what is split (the model axis) plus what is whole.
    assert device_bytes(model) <= split / 4 + whole, plan
    return held


@pytest.mark.parametrize("name", hub_models.NAMES)
def test_kerashub_backbones_train_as_one_device_with_their_kernels_split(name):
    data = hub_models.batch(name, BATCH)
    expected = one_device(lambda: hub_models.model(name), data)
    model = hub_models.model(name, probe=True)
    got = train(model, data, auto())
    assert max_relative_difference(expected, got, noise_floor=1e-3) < 1e-5
    split_probe.assert_divided(split_probe.records(), BATCH, 2)
    split_probe.clear()
    held = assert_held_as_planned(model, auto())
    for path, (shard, shape) in held.items():
        grouped_kv = re.search(r"/(key|value)/kernel$", path)
        large = path.endswith("/kernel") or path.endswith("/embeddings")
        # Every kernel and the token table split 4 ways; a position or
        # segment table has no logical axis a rule splits.
        if large and not grouped_kv and not re.search("position|segment", path):
            assert int(np.prod(shape)) == 4 * int(np.prod(shard)), (path, shard)
        if grouped_kv and name in ("llama", "gemma", "mistral", "qwen"):
            # 2 key/value heads on a model axis of 4: whole (layout_rules).
            assert shard == shape, path


def plain_mlp(model_class=keras.Model):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((16,))
    x = split_probe.probe()(inputs)
    x = keras.layers.Dense(64, activation="relu", name="up")(x)
    x = keras.layers.Dense(32, name="down")(x)
    return model_class(inputs, keras.layers.Dense(8, name="head")(x))


def encoder(model_class=keras.Model):
    keras.utils.set_random_seed(3)
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(64, 32, name="tokens")(tokens)
    x = split_probe.probe()(x)
    h = keras.layers.LayerNormalization(name="norm")(x)
    x = x + keras.layers.MultiHeadAttention(4, 8, name="attention")(h, h)
    h = keras.layers.Dense(64, activation="gelu", name="up")(x)
    x = x + keras.layers.Dense(32, name="down")(h)
    return model_class(tokens, x)


def convnet(model_class=keras.Model):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((12, 12, 3))
    x = split_probe.probe()(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu", name="c1")(x)
    x = keras.layers.Conv2D(16, 3, name="c2")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return model_class(inputs, keras.layers.Dense(4, name="head")(x))


MODELS = {
    "mlp": (plain_mlp, lambda r: (r.normal(size=(64, 16)), r.normal(size=(64, 8)))),
    "encoder": (
        encoder,
        lambda r: (r.integers(0, 64, (64, 8)), r.normal(size=(64, 8, 32))),
    ),
    "convnet": (
        convnet,
        lambda r: (r.normal(size=(64, 12, 12, 3)), r.normal(size=(64, 4))),
    ),
}


def data_of(kind):
    rng = np.random.default_rng(0)
    x, y = MODELS[kind][1](rng)
    return x.astype("int32" if kind == "encoder" else "float32"), y.astype("float32")


# Both doors on the MLP; the other models (and the KerasHub ones above)
# through the callback door, the one a model that cannot be subclassed takes.
@pytest.mark.parametrize(
    "kind, door",
    [
        ("mlp", "compile"),
        ("mlp", "callback"),
        ("encoder", "callback"),
        ("convnet", "callback"),
    ],
)
def test_keras_models_train_as_one_device_through_either_door(kind, door):
    build = MODELS[kind][0]
    data = data_of(kind)
    expected = one_device(build, data)
    model = build(Net if door == "compile" else keras.Model)
    got = train(model, data, auto(), door=door)
    assert max_relative_difference(expected, got, noise_floor=1e-3) < 1e-5
    split_probe.assert_divided(split_probe.records(), BATCH, 2)
    split_probe.clear()
    held = assert_held_as_planned(model, auto())
    # Megatron's pair: the first split by its outputs, the second by its inputs.
    first, second = {
        "mlp": ("up", "down"),
        "encoder": ("up", "down"),
        "convnet": ("c1", "c2"),
    }[kind]
    shard, shape = held[f"{first}/kernel"]
    assert shard[-1] * 4 == shape[-1] and shard[:-1] == shape[:-1]
    shard, shape = held[f"{second}/kernel"]
    assert shard[-2] * 4 == shape[-2] and shard[-1] == shape[-1]


def test_full_shards_split_what_the_rules_leave_over_the_data_axis():
    data = data_of("encoder")
    expected = one_device(encoder, data)
    alone, full = encoder(), encoder()
    train(alone, data, auto())
    split_probe.clear()
    got = train(full, data, auto(shard="full", shard_min_size=1))
    split_probe.assert_divided(split_probe.records(), BATCH, 2)
    assert max_relative_difference(expected, got, noise_floor=1e-3) < 1e-5
    held = shards(full)
    # up: mlp on the model axis (rules), embed on the data axis (shard).
    assert held["up/kernel"] == ((16, 16), (32, 64))
    assert device_bytes(full) < device_bytes(alone)


def test_a_layout_map_key_wins_over_the_rules():
    layout_map = keras.distribution.LayoutMap(mesh())
    layout_map["up/kernel"] = ("model", None)  # Against the rule's (None, model).
    distribution = keras_parallel.ModelParallel(
        layout_map=layout_map, rules="auto", batch_dim_name="data"
    )
    data = data_of("mlp")
    expected = one_device(plain_mlp, data)
    model = plain_mlp()
    got = train(model, data, distribution)
    assert max_relative_difference(expected, got, noise_floor=1e-3) < 1e-5
    split_probe.assert_divided(split_probe.records(), BATCH, 2)
    held = shards(model)
    assert held["up/kernel"] == ((4, 64), (16, 64))
    assert held["down/kernel"] == ((16, 32), (64, 32))  # Still the rules'.
    table = keras_parallel.describe(model, distribution)
    assert re.search(r"up/kernel .*\(model, -\) .* up/kernel", table)
    assert re.search(
        r"down/kernel .*\(mlp, embed\) .*\(model, -\) .*\(rules: mlp->model\)", table
    )


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_a_model_built_inside_the_scope_is_made_split_and_trains_as_one_device(kind):
    if kind == "llama":
        data = hub_models.batch("llama", BATCH)
        build = lambda model_class=None: hub_models.model("llama", probe=True)  # noqa: E731
    else:
        data, build = data_of("mlp"), plain_mlp
    expected = one_device(build, data)
    distribution = auto()
    with distribution.scope():
        model = build(Net) if kind == "mlp" else build()
    made = shards(model)  # As made, before any plan.
    if kind == "mlp":
        assert made["up/kernel"] == ((16, 16), (16, 64))
        assert made["down/kernel"] == ((16, 32), (64, 32))
    else:
        block = "transformer_layer_0"
        query = made[f"{block}/self_attention/query/kernel"]
        assert query == ((64, 2, 8), (64, 8, 8))
        gate = made[f"{block}/feedforward_gate_dense/kernel"]
        assert gate == ((64, 64), (64, 256))
        down = made[f"{block}/feedforward_output_dense/kernel"]
        assert down == ((64, 64), (256, 64))
        assert made["token_embedding/embeddings"] == ((64, 64), (256, 64))
    door = "compile" if kind == "mlp" else "callback"
    got = train(model, data, distribution, door=door)
    assert max_relative_difference(expected, got, noise_floor=1e-3) < 1e-5
    split_probe.assert_divided(split_probe.records(), BATCH, 2)
    assert shards(model) == made  # The plan agreed with the layouts made.


def test_a_second_model_built_in_one_scope_is_made_as_the_first():
    distribution = auto()
    with distribution.scope():
        first = shards(plain_mlp())
        second = shards(plain_mlp())
    assert first == second
    assert first["down/kernel"] == ((16, 32), (64, 32))


def test_a_model_built_by_its_first_call_in_the_scope_is_planned_right():
    # Keras builds a subclassed model called in the scope later, in the
    # model's name scope: no variable takes the model's axes for its own.
    class Mlp(keras.Model):
        def __init__(self):
            super().__init__(name="mlp")
            self.up = keras.layers.Dense(64, activation="relu", name="up")
            self.down = keras.layers.Dense(16, name="down")
            self.probe = split_probe.probe()

        def call(self, x):
            return self.down(self.up(self.probe(x)))

    data = (data_of("mlp")[0], data_of("mlp")[0])

    def build():
        keras.utils.set_random_seed(5)
        model = Mlp()
        model(np.zeros((1, 16), "float32"))
        return model

    expected = one_device(build, data)
    distribution = auto()
    with distribution.scope():
        model = build()
    got = train(model, data, distribution)
    assert max_relative_difference(expected, got) < 1e-5
    split_probe.assert_divided(split_probe.records(), BATCH, 2)
    held = shards(model)
    assert held["mlp/up/kernel"] == ((16, 16), (16, 64))
    assert held["mlp/down/kernel"] == ((16, 16), (64, 16))


def test_a_layout_map_and_rules_together_warn_only_of_the_rule_that_splits_nothing():
    layout_map = keras.distribution.LayoutMap(mesh())
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    distribution = keras_parallel.ModelParallel(
        layout_map=layout_map, rules=[("vocab", "model")], batch_dim_name="data"
    )
    with pytest.warns(UserWarning) as warned:
        keras_parallel.describe(plain_mlp(), distribution)
    messages = [str(w.message) for w in warned]
    assert any("Rule ('vocab', 'model') splits nothing" in m for m in messages)
    assert not any("Mesh axis" in m for m in messages), messages


def test_a_model_axis_that_divides_nothing_warns():
    devices = keras.distribution.list_devices()[:6]
    three = keras.distribution.DeviceMesh((2, 3), ["data", "model"], devices)
    distribution = keras_parallel.ModelParallel(
        device_mesh=three, rules="auto", batch_dim_name="data"
    )
    with pytest.warns(
        UserWarning, match=r"Mesh axis 'model' \(size 3\) splits no variable"
    ):
        keras_parallel.describe(plain_mlp(), distribution)


def test_describe_shows_each_variables_logical_axes_and_its_rule():
    model = hub_models.model("llama")
    table = keras_parallel.describe(model, auto())
    line = next(x for x in table.splitlines() if "0/self_attention/key/kernel" in x)
    assert "(embed, kv_heads, kv_head_dim)" in line
    assert "(-, -, -)" in line
    assert "model does not divide kv_heads 2" in line
    line = next(
        x for x in table.splitlines() if "0/feedforward_output_dense/kernel" in x
    )
    assert "(mlp, embed)" in line and "(model, -)" in line and "mlp->model" in line


# ----------------------------------------------- against KerasHub's own maps
COLLECTIVE = re.compile(
    r"= (\(?[a-z0-9]+\[[0-9,]*\].*?) "
    r"(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(-start)?\("
)


def collectives(recorded):
    """`(count, bytes)` of the collectives in the optimized HLO of the last step."""
    compiled, args = recorded[-1]
    count, total = 0, 0
    for line in compiled.lower(*args).compile().as_text().splitlines():
        match = COLLECTIVE.search(line)
        if match:
            count += 1
            for bits, dims in re.findall(r"[a-z]+(\d+)\[([0-9,]*)\]", match.group(1)):
                total += (
                    int(np.prod([int(d) for d in dims.split(",") if d]))
                    * int(bits)
                    // 8
                )
    return count, total


def measured(name, distribution, recorded):
    split_probe.clear()
    model = hub_models.model(name, probe=True)
    weights = train(model, hub_models.batch(name, BATCH), distribution)
    return weights, device_bytes(model), collectives(recorded)


def test_kerashub_llama_auto_and_full_is_no_worse_than_its_own_map(recorded_steps):
    name = "llama"
    expected = one_device(lambda: hub_models.model(name), hub_models.batch(name, BATCH))
    hub_map = hub_models.require().models.LlamaBackbone.get_layout_map(
        mesh(), model_parallel_dim_name="model", data_parallel_dim_name="data"
    )
    theirs = keras_parallel.ModelParallel(layout_map=hub_map, batch_dim_name="data")
    _, their_bytes, (their_count, their_traffic) = measured(
        name, theirs, recorded_steps
    )
    got, our_bytes, (our_count, our_traffic) = measured(
        name, auto(shard="full"), recorded_steps
    )
    assert max_relative_difference(expected, got, noise_floor=1e-3) < 1e-5
    split_probe.assert_divided(split_probe.records(), BATCH, 2)
    assert our_bytes <= their_bytes
    assert our_count <= their_count
    assert our_traffic <= their_traffic


def test_kerashub_qwen_auto_moves_less_and_holds_more_only_by_its_whole_kv(
    recorded_steps,
):
    name = "qwen"
    hub_map = hub_models.require().models.QwenBackbone.get_layout_map(
        mesh(), model_parallel_dim_name="model", data_parallel_dim_name="data"
    )
    theirs = keras_parallel.ModelParallel(layout_map=hub_map, batch_dim_name="data")
    _, their_bytes, (their_count, their_traffic) = measured(
        name, theirs, recorded_steps
    )
    model = hub_models.model(name)
    train(model, hub_models.batch(name, BATCH), auto(shard="full"))
    our_count, our_traffic = collectives(recorded_steps)
    assert our_count <= their_count
    assert our_traffic <= their_traffic
    # KerasHub splits the 2 key/value heads over the data axis and their
    # inputs over the model axis; the rules keep them whole over the model
    # axis (fewer collectives, above). That is the only extra a device holds.
    kv = sum(
        v.value.nbytes
        for v in model.weights
        if re.search(r"/(key|value)/(kernel|bias)$", v.path)
    )
    assert their_bytes < device_bytes(model) <= their_bytes + kv


def test_kerashub_gemmas_own_map_fails_on_fewer_kv_heads_than_devices_and_the_rules_place_it():
    hub_map = hub_models.require().models.GemmaBackbone.get_layout_map(
        mesh(), model_parallel_dim_name="model", data_parallel_dim_name="data"
    )
    theirs = keras_parallel.ModelParallel(layout_map=hub_map, batch_dim_name="data")
    with pytest.raises(
        ValueError, match="key/kernel' cannot be split over mesh axis 'model'"
    ):
        keras_parallel.describe(hub_models.model("gemma"), theirs)
    table = keras_parallel.describe(hub_models.model("gemma"), auto())
    key = next(x for x in table.splitlines() if "0/attention/key/kernel" in x)
    assert "(-, -, -)" in key and "model does not divide kv_heads 2" in key
    query = next(x for x in table.splitlines() if "0/attention/query/kernel" in x)
    assert "(model, -, -)" in query
