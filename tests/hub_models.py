"""Small random KerasHub backbones (no download) and batches for them.

Each is two blocks of the family's real layers at toy sizes, wrapped as a
functional model whose one output is the sequence of hidden states, so a
test trains it with `mse` against random targets. The grouped-query models
have 2 key/value heads: fewer than a model axis of 4 has devices.
"""

import numpy as np

VOCAB, SEQ, HIDDEN, HEADS, KV_HEADS, FFW = 256, 8, 64, 8, 2, 256
#: Families with a `get_layout_map` of their own in KerasHub.
WITH_LAYOUT_MAP = ("llama", "gemma", "qwen")
NAMES = ("llama", "gemma", "mistral", "qwen", "gpt2", "bert")


def available():
    """Whether KerasHub imports here (0.32 does not with keras-nightly 3.16)."""
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        return False
    return True


def require():
    """`keras_hub`, or the calling test skipped with why."""
    import pytest

    return pytest.importorskip(
        "keras_hub",
        reason="KerasHub is not installed or does not import with this Keras "
        "(tox installs it in the default jax and torch envs only)",
        exc_type=ImportError,
    )


def backbone(name):
    """The small backbone of a family, e.g. `backbone("llama")`."""
    models = require().models
    common = dict(
        vocabulary_size=VOCAB, num_layers=2, hidden_dim=HIDDEN, intermediate_dim=FFW
    )
    grouped = dict(common, num_query_heads=HEADS, num_key_value_heads=KV_HEADS)
    encoder = dict(common, num_heads=HEADS, max_sequence_length=SEQ, dropout=0.0)
    if name == "llama":
        return models.LlamaBackbone(**grouped)
    if name == "gemma":
        return models.GemmaBackbone(**grouped, head_dim=HIDDEN // HEADS)
    if name == "mistral":
        return models.MistralBackbone(**grouped)
    if name == "qwen":
        return models.QwenBackbone(**grouped)
    if name == "gpt2":
        return models.GPT2Backbone(**encoder)
    if name == "bert":
        return models.BertBackbone(**encoder)
    raise ValueError(f"Unknown family {name!r}; use one of {NAMES}.")


def model(name, seed=1, probe=False, model_class=None):
    """The backbone as a functional model of one output, from a fixed seed.

    With `probe`, the output passes a `split_probe` layer, which records the
    rows one device computed in each step. `model_class` (default
    `keras.Model`) is the functional model's class, e.g. a
    `DistributedModel`.
    """
    import keras
    import split_probe

    keras.utils.set_random_seed(seed)
    hub = backbone(name)
    output = hub.output
    if isinstance(output, dict):
        output = output["sequence_output"]
    if probe:
        output = split_probe.probe()(output)
    return (model_class or keras.Model)(hub.input, output, name=name)


def batch(name, n=8):
    """`(inputs, targets)`: `n` random sequences and hidden-state targets."""
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, VOCAB, (n, SEQ)).astype("int32"),
        "padding_mask": np.ones((n, SEQ), "int32"),
    }
    if name == "bert":
        x["segment_ids"] = np.zeros((n, SEQ), "int32")
    return x, rng.normal(size=(n, SEQ, HIDDEN)).astype("float32")
