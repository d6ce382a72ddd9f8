"""Each variable's logical axes: what its dimensions mean, from its layer.

A logical axis names a dimension's role (`"embed"`, `"mlp"`), which
`layout_rules` maps to mesh axes. Dense-like layers are paired as in Megatron
(column then row: one all-reduce a block) in the order a symbolic forward pass
calls them; layers called on one input (gate and up) are siblings.
"""

import dataclasses
import re
import warnings

import keras

EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
KV_HEAD_DIM = "kv_head_dim"
VOCAB = "vocab"
NORM = "norm"
POSITION = "position"
SPATIAL = "spatial"

#: Every logical axis name a derived layout uses.
NAMES = (
    EMBED,
    MLP,
    HEADS,
    KV_HEADS,
    HEAD_DIM,
    KV_HEAD_DIM,
    VOCAB,
    NORM,
    POSITION,
    SPATIAL,
)


@dataclasses.dataclass(frozen=True)
class LogicalAxes:
    """One variable's logical axes.

    Attributes:
        names: one logical axis name (or `None`) per dimension.
        role: what the variable is for, e.g. `"column of a pair"`,
            `"query"`, `"embedding"`.
    """

    names: tuple
    role: str


def of_model(model):
    """The logical axes of every variable of a built model whose layer is known.

    Returns:
        `{variable path: LogicalAxes}`; a variable of an unknown layer is absent
        (and stays whole).
    """
    owned = _variables_by_layer(model)
    kernels = {
        id(layer): tuple(variables["kernel"].shape)
        for layer, variables in owned
        if _is_pairable(layer)
        and len(getattr(variables.get("kernel"), "shape", ())) >= 2
    }
    roles = _pair(model, [layer for layer, _ in owned], kernels)
    axes = {}
    for layer, variables in owned:
        for name, variable in variables.items():
            shape = tuple(variable.shape)
            if id(layer) in kernels:
                role = roles[id(layer)]
                names = _paired_axes(name, len(shape), role)
                found = None if names is None else (names, f"{role} of a pair")
            else:
                found = _static_axes(layer, name, shape)
            if found is not None:
                axes.setdefault(variable.path, []).append(LogicalAxes(*found))
    # Two variables of one path (a subclassed model's layers of one name)
    # cannot be told apart by the plan: both stay whole.
    return {path: found[0] for path, found in axes.items() if len(found) == 1}


def _variables_by_layer(model):
    """`[(layer, {variable name: variable})]`, each variable with its own layer."""
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    owner = {}
    # Deepest first: a variable belongs to the innermost layer holding it.
    for layer in reversed(layers):
        for variable in layer.weights:
            owner.setdefault(id(variable), (layer, variable))
    by_layer = {}
    for layer, variable in owner.values():
        by_layer.setdefault(id(layer), (layer, {}))[1][variable.name] = variable
    return [by_layer[id(layer)] for layer in layers if id(layer) in by_layer]


def _is_pairable(layer):
    if isinstance(layer, keras.layers.Dense):
        return True
    if isinstance(layer, keras.layers.EinsumDense):
        parsed = _einsum_parts(layer)
        return parsed is not None and parsed[1] == ("in", "out")
    return isinstance(
        layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
    )


def _paired_axes(name, rank, role):
    first, second = (EMBED, MLP) if role == "column" else (MLP, EMBED)
    if name == "kernel":
        return (SPATIAL,) * (rank - 2) + (first, second)
    if name == "bias" and rank == 1:
        return (second,)
    return None


def _einsum_parts(layer):
    """`((inputs, kernel, output), roles)`: the equation's letters, and per
    kernel dimension `"in"` (contracted), `"out"` or `None`; or `None`."""
    # `...` stands for dimensions the kernel does not have.
    equation = layer.equation.replace("...", "")
    match = re.fullmatch(r"\s*(\w+)\s*,\s*(\w+)\s*->\s*(\w+)\s*", equation)
    if match is None:
        return None
    inputs, kernel, output = match.groups()
    return (inputs, kernel, output), tuple(
        "in"
        if c in inputs and c not in output
        else "out"
        if c in output and c not in inputs
        else None
        for c in kernel
    )


def _einsum_axes(layer, name, shape):
    """An attention projection's axes, from its equation."""
    parsed = _einsum_parts(layer)
    if parsed is None:
        return None
    (inputs, kernel, output), roles = parsed
    is_kv = re.search(r"key|value", layer.name) is not None
    heads, head_dim = (KV_HEADS, KV_HEAD_DIM) if is_kv else (HEADS, HEAD_DIM)

    def letters(role, order):
        found = [c for c, r in zip(kernel, roles, strict=True) if r == role]
        return sorted(found, key=order.index)

    contracted, produced = letters("in", inputs), letters("out", output)
    if len(contracted) == 1 and len(produced) == 2:
        # Into heads: the output's first split letter is the heads.
        head_letters, embed_letters = produced, contracted
        role = "key/value" if is_kv else "query"
    elif len(contracted) == 2 and len(produced) == 1:
        head_letters, embed_letters = contracted, produced
        heads, head_dim, role = HEADS, HEAD_DIM, "attention output"
    else:
        return None
    kernel_names = dict(zip(head_letters, (heads, head_dim), strict=True))
    kernel_names.update(dict.fromkeys(embed_letters, EMBED))
    if name == "kernel":
        return tuple(kernel_names.get(c) for c in kernel), role
    bias_axes = getattr(layer, "bias_axes", None)
    if name == "bias" and bias_axes and len(bias_axes) == len(shape):
        return tuple(kernel_names.get(c) for c in bias_axes), role
    return None


def _static_axes(layer, name, shape):
    """`(names, role)` for a variable of a layer that is not paired."""
    if isinstance(layer, keras.layers.EinsumDense):
        return _einsum_axes(layer, name, shape)
    if isinstance(layer, keras.layers.Embedding) and len(shape) == 2:
        if name == "embeddings":
            return (VOCAB, EMBED), "embedding"
        if name == "reverse_embeddings":
            return (EMBED, VOCAB), "output embedding"
    kind = type(layer).__name__
    if "PositionEmbedding" in kind and name == "embeddings" and len(shape) == 2:
        return (POSITION, EMBED), "position embedding"
    if "Norm" in kind and len(shape) == 1:
        return (NORM,), "normalization"
    return None


class Pairs:
    """Megatron's pairs, decided one dense-like layer at a time, in call order.

    A layer taking the open pair's output features, and not a sibling of its
    first layers, is its second (`"row"`); else it opens or joins a pair's
    first layers (`"column"`). A weighted layer mixing features closes the pair.
    """

    def __init__(self):
        self.roles = {}
        self._columns = []  # The open pair's first layers: (input, features).

    def close(self):
        """A layer that mixes features ran: no pair stays open across it."""
        self._columns = []

    def role(self, layer, features_in, features_out, inputs=None):
        """The layer's role, `"column"` or `"row"`, decided at its first call.

        Args:
            features_in: the kernel's second last size.
            features_out: the kernel's last size.
            inputs: the tensor it was called on, or `None` when unknown.
        """
        if id(layer) in self.roles:
            return self.roles[id(layer)]
        is_sibling = inputs is not None and any(i is inputs for i, _ in self._columns)
        feeds_on_columns = any(out == features_in for _, out in self._columns)
        if self._columns and not is_sibling and feeds_on_columns:
            self._columns = []
            role = "row"
        else:
            if not is_sibling:
                self._columns = []
            self._columns.append((inputs, features_out))
            role = "column"
        self.roles[id(layer)] = role
        return role


def _pair(model, layers, kernels):
    """`{id(layer): "column" or "row"}` for the layers of `kernels`
    (`{id(layer): kernel shape}`), among `layers` (those holding variables)."""
    pairable = [layer for layer in layers if id(layer) in kernels]
    if not pairable:
        return {}
    calls = _call_order(model, [layer for layer in layers if layer is not model])
    if calls is None:
        warnings.warn(
            f"Model {model.name!r} could not be traced symbolically, so its "
            "dense layers are paired (Megatron's column then row) in the order "
            "the model holds them, which may not be the order it calls them. "
            "Check keras_parallel.describe(model, distribution), and give a "
            "LayoutMap key for a variable placed wrong (a key wins over the "
            "rules), or build the model with model.build(shape) first.",
            stacklevel=5,
        )
        calls = [(layer, None) for layer in pairable]
    pairs = Pairs()
    for layer, inputs in calls:
        if id(layer) in kernels:
            pairs.role(layer, *kernels[id(layer)][-2:], inputs=inputs)
        elif not isinstance(layer, keras.layers.BatchNormalization):
            # It normalizes each feature alone: a pair of convolutions stays open.
            pairs.close()
    return {id(layer): pairs.roles.get(id(layer), "column") for layer in pairable}


def of_new_variable(layer, variable, pairs):
    """The `LogicalAxes` of a variable `layer` is making, or `None`.

    For a model built in a distribution's scope: layers are built in call order
    but their inputs are unknown, so a sibling of matching sizes is taken for a
    pair's second (the plan, which traces the model, moves what it places
    otherwise). `pairs` holds the layers made before in this scope.
    """
    shape = tuple(variable.shape)
    if _is_pairable(layer):
        if variable.name == "kernel" and len(shape) >= 2:
            role = pairs.role(layer, shape[-2], shape[-1])
        else:
            role = pairs.roles.get(id(layer))
        names = None if role is None else _paired_axes(variable.name, len(shape), role)
        return None if names is None else LogicalAxes(names, f"{role} of a pair")
    if not isinstance(layer, keras.layers.BatchNormalization):
        pairs.close()  # As a call of it would (`_pair`).
    found = _static_axes(layer, variable.name, shape)
    return None if found is None else LogicalAxes(*found)


def _symbolic_inputs(model):
    """A functional model's inputs, or a subclassed one's from its build shape."""
    try:
        return model.input
    except (AttributeError, ValueError):
        pass
    shape = (model.get_build_config() or {}).get("input_shape")
    if not isinstance(shape, (list, tuple)) or not all(
        d is None or isinstance(d, int) for d in shape
    ):
        return None  # Never built by `build(shape)`, or several inputs.
    return keras.KerasTensor(tuple(shape), dtype=model.input_dtype)


def _with_known_sizes(inputs):
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(
            tuple(1 if d is None else d for d in t.shape), dtype=t.dtype
        ),
        inputs,
    )


def _call_order(model, layers):
    """`[(layer, its input)]` in the order a symbolic pass calls them, or
    `None` where the model has no symbolic inputs or cannot be traced."""
    from keras_parallel.keras_seam.keras_compat import compute_output_spec

    inputs = _symbolic_inputs(model)
    if inputs is None:
        return None
    calls, wrapped = [], []

    def recorder(layer, call):
        def call_recorded(inputs, *args, **kwargs):
            # The input itself, not its id: a freed tensor's id is reused.
            calls.append((layer, inputs))
            return call(inputs, *args, **kwargs)

        return call_recorded

    try:
        for layer in layers:
            had_own = "call" in vars(layer)
            wrapped.append((layer, had_own, vars(layer).get("call")))
            object.__setattr__(layer, "call", recorder(layer, layer.call))
        # Unknown sizes as 1 first: torch traces an unknown size eagerly
        # where "meta" fails, at 83 and 89 (a whole forward pass of a batch
        # of 83), and JAX cannot compare a symbolic length with a position
        # table's size (GPT-2). Then as they are (for a convolution that
        # size 1 is too small for).
        for sized in (_with_known_sizes(inputs), inputs):
            calls.clear()
            try:
                # The model's warnings about size-1 inputs are not the user's.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    compute_output_spec(model.call, sized)
                break
            except Exception:  # Not traceable so: try the next, or give up.
                continue
        else:
            return None
    finally:
        for layer, had_own, own in wrapped:
            if had_own:
                object.__setattr__(layer, "call", own)
            else:
                object.__delattr__(layer, "call")
    return calls
