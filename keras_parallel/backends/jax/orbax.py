"""Reads an `OrbaxCheckpoint` into the layout of each variable it restores.

Each saved leaf is asked for with its variable's sharding, so Orbax reads
only each device's part, whatever mesh it was saved on.
"""

import difflib

import jax
import orbax.checkpoint as _orbax

from keras_parallel.keras_seam.model_state import binding_of

_ocp = _orbax.v1

_MODEL_GROUPS = ("trainable_variables", "non_trainable_variables")


def restore(model, path):
    """Restores one step's folder (it holds `pytree/`) of an
    `OrbaxCheckpoint` into a built `model`.

    Raises:
        ValueError: the model is not built, or the checkpoint's variables or
            shapes differ from the model's. No variable was assigned (an
            unbuilt optimizer was built, as `fit` would).
    """
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so it has no variables to "
            f"restore into. Received: an unbuilt model and {path!r}; build it "
            "first (call it on a batch, or `model.build(input_shape)`)."
        )
    _build_optimizer(model)
    binding = binding_of(model)
    if binding is not None:
        # Each array is read into its variable's layout: the plan is applied
        # first (the step counter and learning rate of an optimizer just
        # built join it, replicated); inside a run, through the run.
        if binding.run is not None:
            binding.run.model_built()
        else:
            binding.apply(model)
    # Under the caller's `orbax.checkpoint.v1.Context`, if any.
    saved = _ocp.metadata(path, checkpointable_name="pytree").metadata
    pairs = _match(model, saved, path)
    abstract = _abstract_tree(saved, pairs)
    loaded = _ocp.load_checkpointables(path, {"pytree": abstract})["pytree"]
    # Assigned once all is read: a failed read leaves the model unchanged.
    for variable, keys in pairs:
        variable.assign(_leaf(loaded, keys))


def _build_optimizer(model):
    """Builds an unbuilt optimizer (Keras builds it at the first `fit`), so
    its state has variables to restore into."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return
    optimizer.build(model.trainable_variables)


def _groups(model):
    """`{group: [variables]}`, the groups `model.get_state_tree()` saves."""
    optimizer = getattr(model, "optimizer", None)
    return {
        "trainable_variables": list(model.trainable_variables),
        "non_trainable_variables": list(model.non_trainable_variables),
        "optimizer_variables": list(optimizer.variables) if optimizer else [],
        "metrics_variables": list(getattr(model, "metrics_variables", [])),
    }


def _flatten(tree, prefix=()):
    """`{key tuple: leaf}` of a nested dict."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, prefix + (key,)))
        else:
            flat[prefix + (key,)] = value
    return flat


def _match(model, saved, path):
    """`[(variable, key tuple of its saved leaf)]`.

    The optimizer's variables are matched without the optimizer's name,
    which Keras numbers per process (`adam`, `adam_1`). Metric variables are
    restored where both have them: Keras makes some only at the first `fit`.
    """
    pairs = []
    for group, variables in _groups(model).items():
        leaves = {
            "/".join(keys): (group,) + keys for keys in _flatten(saved.get(group) or {})
        }
        if group == "optimizer_variables":
            leaves = {_without_owner(name): keys for name, keys in leaves.items()}
        wanted = {}
        for variable in variables:
            name = variable.path
            if group == "optimizer_variables":
                name = _without_owner(name)
            wanted[name] = variable
        # An uncompiled model or a weights-only checkpoint: weights alone.
        if group in _MODEL_GROUPS or (
            group == "optimizer_variables" and leaves and wanted
        ):
            _check_same_names(model, group, wanted, leaves, path)
        for name, variable in wanted.items():
            if name in leaves:
                _check_shape(variable, _leaf(saved, leaves[name]), path)
                pairs.append((variable, leaves[name]))
    return pairs


def _without_owner(name):
    return name.split("/", 1)[-1]


def _leaf(tree, keys):
    for key in keys:
        tree = tree[key]
    return tree


def _check_same_names(model, group, wanted, leaves, path):
    missing = sorted(set(wanted) - set(leaves))
    extra = sorted(set(leaves) - set(wanted))
    if not missing and not extra:
        return
    hints = []
    for name in missing[:3]:
        close = difflib.get_close_matches(name, extra, n=1)
        if close:
            hints.append(f"{name!r} ~ saved {close[0]!r}")
    hint = f" Closest: {'; '.join(hints)}." if hints else ""
    fix = (
        "compile the model with the same optimizer as the one saved"
        if group == "optimizer_variables"
        else "build the model with the same layers and layer names as the one saved"
    )
    raise ValueError(
        f"The checkpoint's {group} differ from model {model.name!r}'s, so it "
        f"cannot be restored into it. Received: {path!r}, whose {group} lack "
        f"{missing[:5]} ({len(missing)} in all) and hold {extra[:5]} "
        f"({len(extra)} in all) that the model lacks.{hint} Instead, {fix}."
    )


def _check_shape(variable, leaf, path):
    if tuple(leaf.shape) != tuple(variable.shape):
        raise ValueError(
            f"Variable {variable.path!r} has shape {tuple(variable.shape)}, but "
            f"the checkpoint saved shape {tuple(leaf.shape)} for it. Received: "
            f"{path!r}, saved {_describe_layout(leaf)}; build the model with "
            "the same layer sizes as the one saved."
        )


def _describe_layout(leaf):
    """`on mesh (2, 4) ('data', 'model') as P(None, 'model')`, or less."""
    sharding = getattr(leaf, "sharding_metadata", None)
    shape = getattr(sharding, "shape", None)
    if shape is None:
        return "unsharded"
    axes = tuple(getattr(sharding, "axis_names", ()))
    spec = tuple(getattr(sharding, "partition_spec", ()))
    return f"on mesh {tuple(int(s) for s in shape)} {axes} as {spec}"


def _abstract_tree(saved, pairs):
    """The checkpoint's tree, each leaf in its variable's layout; a leaf no
    variable restores is a `PLACEHOLDER`, not read."""
    wanted = {keys: variable for variable, keys in pairs}

    def abstract(keys, leaf):
        variable = wanted.get(keys)
        if variable is None:
            return _ocp.PLACEHOLDER
        value = variable.value
        return jax.ShapeDtypeStruct(
            tuple(leaf.shape), value.dtype, sharding=value.sharding
        )

    def walk(tree, prefix):
        return {
            key: walk(value, prefix + (key,))
            if isinstance(value, dict)
            else abstract(prefix + (key,), value)
            for key, value in tree.items()
        }

    return walk(saved, ())
