"""Each variable's logical axes, derived from its layer (any backend)."""

import hub_models
import keras
import pytest

from keras_parallel.plan import logical_axes


def names_of(model):
    return {path: axes.names for path, axes in logical_axes.of_model(model).items()}


def test_a_dense_chain_pairs_column_then_row():
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(32, name="down")(h)
    outputs = keras.layers.Dense(10, name="head")(h)
    found = names_of(keras.Model(inputs, outputs))
    assert found == {
        "up/kernel": ("embed", "mlp"),
        "up/bias": ("mlp",),
        "down/kernel": ("mlp", "embed"),
        "down/bias": ("embed",),
        "head/kernel": ("embed", "mlp"),
        "head/bias": ("mlp",),
    }


def test_layers_called_on_one_input_are_siblings_of_a_pair():
    # A gated MLP whose sizes are all equal: only the call graph tells that
    # `up` is the gate's sibling, not the layer the gate feeds.
    inputs = keras.Input((32,))
    gate = keras.layers.Dense(32, activation="gelu", name="gate")(inputs)
    up = keras.layers.Dense(32, name="up")(inputs)
    outputs = keras.layers.Dense(32, name="down")(gate * up)
    found = names_of(keras.Model(inputs, outputs))
    assert found["gate/kernel"] == ("embed", "mlp")
    assert found["up/kernel"] == ("embed", "mlp")
    assert found["down/kernel"] == ("mlp", "embed")


def test_attention_projections_by_heads_and_the_output_by_its_input():
    inputs = keras.Input((8, 32))
    attention = keras.layers.MultiHeadAttention(4, 8, name="attention")
    h = keras.layers.LayerNormalization(name="norm")(inputs)
    outputs = attention(h, h)
    found = names_of(keras.Model(inputs, outputs))
    assert found["attention/query/kernel"] == ("embed", "heads", "head_dim")
    assert found["attention/query/bias"] == ("heads", "head_dim")
    assert found["attention/key/kernel"] == ("embed", "kv_heads", "kv_head_dim")
    assert found["attention/value/kernel"] == ("embed", "kv_heads", "kv_head_dim")
    assert found["attention/attention_output/kernel"] == ("heads", "head_dim", "embed")
    assert found["attention/attention_output/bias"] == ("embed",)
    assert found["norm/gamma"] == ("norm",)
    assert found["norm/beta"] == ("norm",)


def test_embeddings_and_convolutions():
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(100, 16, name="tokens")(tokens)
    x = keras.layers.Conv1D(24, 3, name="c1")(x)
    x = keras.layers.Conv1D(16, 3, name="c2")(x)
    found = names_of(keras.Model(tokens, x))
    assert found["tokens/embeddings"] == ("vocab", "embed")
    assert found["c1/kernel"] == ("spatial", "embed", "mlp")
    assert found["c2/kernel"] == ("spatial", "mlp", "embed")
    assert found["c2/bias"] == ("embed",)


def test_a_subclassed_model_pairs_in_the_order_its_layers_were_made():
    class Mlp(keras.Model):
        def __init__(self):
            super().__init__()
            # Attributes in another order than the calls.
            self.down = keras.layers.Dense(8, name="down")
            self.up = keras.layers.Dense(32, name="up")

        def build(self, shape):
            self.up.build(shape)
            self.down.build((None, 32))

        def call(self, x):
            return self.down(self.up(x))

    model = Mlp()
    model.build((None, 8))
    found = {p.split("/", 1)[1]: n for p, n in names_of(model).items()}
    assert found["up/kernel"] == ("embed", "mlp")
    assert found["down/kernel"] == ("mlp", "embed")


def test_a_pair_does_not_stay_open_across_a_layer_that_mixes_features():
    # A ViT: the patch convolution opens a pair, but norms and attention
    # come before the MLP, whose up projection must open its own.
    images = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(32, 4, strides=4, name="patches")(images)
    x = keras.layers.Reshape((16, 32))(x)
    h = keras.layers.LayerNormalization(name="norm_1")(x)
    x = x + keras.layers.MultiHeadAttention(4, 8, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="norm_2")(x)
    h = keras.layers.Dense(128, activation="gelu", name="up")(h)
    x = x + keras.layers.Dense(32, name="down")(h)
    found = names_of(keras.Model(images, x))
    assert found["up/kernel"] == ("embed", "mlp")
    assert found["down/kernel"] == ("mlp", "embed")


def test_a_batch_normalization_keeps_a_pair_of_convolutions_open():
    images = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(16, 3, name="c1")(images)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Conv2D(8, 3, name="c2")(keras.layers.ReLU()(x))
    found = names_of(keras.Model(images, x))
    assert found["c1/kernel"][-2:] == ("embed", "mlp")
    assert found["c2/kernel"][-2:] == ("mlp", "embed")


def test_an_einsum_dense_with_an_ellipsis_pairs():
    inputs = keras.Input((4, 16))
    h = keras.layers.EinsumDense("...b,bc->...c", (64,), name="up")(inputs)
    outputs = keras.layers.EinsumDense("...c,cb->...b", (16,), name="down")(h)
    found = names_of(keras.Model(inputs, outputs))
    assert found["up/kernel"] == ("embed", "mlp")
    assert found["down/kernel"] == ("mlp", "embed")


def test_two_variables_of_one_path_stay_whole():
    class Twice(keras.Model):
        def __init__(self):
            super().__init__(name="twice")
            self.a = keras.layers.EinsumDense("abc,cde->abde", (8, 4, 8), name="proj")
            self.b = keras.layers.Dense(32, name="proj")

        def call(self, x):
            return self.b(keras.ops.reshape(self.a(x), (-1, 8, 32)))

    model = Twice()
    model(keras.ops.ones((2, 8, 16)))
    paths = [v.path for v in model.weights if v.path.endswith("kernel")]
    assert paths[0] == paths[1]  # Keras gives both kernels one path.
    assert paths[0] not in names_of(model)


def test_a_model_it_cannot_trace_is_paired_in_the_order_it_holds_its_layers():
    import numpy as np

    class Untraceable(keras.Model):
        def __init__(self):
            super().__init__(name="untraceable")
            self.up = keras.layers.Dense(32, name="up")
            self.down = keras.layers.Dense(8, name="down")
            self.refuses = False

        def call(self, x):
            if self.refuses:  # As a model whose call a trace cannot run.
                raise ValueError("this model runs on real batches only")
            return self.down(self.up(x))

    model = Untraceable()
    model(np.ones((2, 8), "float32"))
    model.refuses = True
    with pytest.warns(UserWarning, match="'untraceable' could not be traced"):
        found = {p.split("/", 1)[1]: n for p, n in names_of(model).items()}
    assert found["up/kernel"] == ("embed", "mlp")
    assert found["down/kernel"] == ("mlp", "embed")


def test_a_layer_it_does_not_know_has_no_logical_axes():
    class Scale(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 3), name="w")

        def call(self, x):
            return x @ self.w

    inputs = keras.Input((4,))
    model = keras.Model(inputs, Scale(name="scale")(inputs))
    assert names_of(model) == {}


MLP_LAYERS = {
    # (up projections, down projection) of every block's MLP.
    "gemma": (("ffw_gating", "ffw_gating_2"), "ffw_linear"),
    "gpt2": (("feedforward_intermediate_dense",), "feedforward_output_dense"),
    "bert": (("feedforward_intermediate_dense",), "feedforward_output_dense"),
}
UP_AND_GATE = (
    ("feedforward_intermediate_dense", "feedforward_gate_dense"),
    "feedforward_output_dense",
)
ATTENTION = {"gemma": "attention", "bert": "self_attention_layer"}


@pytest.mark.parametrize("name", hub_models.NAMES)
def test_kerashub_backbones(name):
    found = logical_axes.of_model(hub_models.model(name))
    block = "decoder_block" if name == "gemma" else "transformer_layer"
    attention = f"{block}_0/{ATTENTION.get(name, 'self_attention')}"
    query = found[f"{attention}/query/kernel"].names
    key = found[f"{attention}/key/kernel"].names
    output = found[f"{attention}/attention_output/kernel"].names
    # The heads' axis is the output's first split letter, whatever the
    # family's equation calls it (Gemma: `ndh`, Llama: `muh`).
    if name == "gemma":
        assert query == ("heads", "embed", "head_dim")
        assert key == ("kv_heads", "embed", "kv_head_dim")
    else:
        assert query == ("embed", "heads", "head_dim")
        assert key == ("embed", "kv_heads", "kv_head_dim")
    assert output == ("heads", "head_dim", "embed")
    assert found["token_embedding/embeddings"].names == ("vocab", "embed")
    ups, down = MLP_LAYERS.get(name, UP_AND_GATE)
    for index in range(2):
        for up in ups:
            assert found[f"{block}_{index}/{up}/kernel"].names == ("embed", "mlp")
        assert found[f"{block}_{index}/{down}/kernel"].names == ("mlp", "embed")
