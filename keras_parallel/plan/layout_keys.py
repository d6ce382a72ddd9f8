"""Matching `LayoutMap` keys to variables and layer outputs, as Keras does.

A variable key is a regex matched in full against `variable.path`, an exact key
winning; an output key (`.../output`) also finds a nested layer by path suffix;
optimizer slots follow their variable (docs/jax.md).
"""

import difflib
import re
import warnings

from keras_parallel.errors import ShardingError, UnmatchedLayoutKeyWarning

OUTPUT_SUFFIX = "/output"


def variable_axes(distribution, variable, variable_keys, layout_map):
    """Returns `(axes, key)` for one model variable."""
    rank = len(variable.shape)
    if layout_map is None:
        from keras.distribution import DataParallel

        if isinstance(distribution, DataParallel):
            return (None,) * rank, "(replicated)"
        # A custom Distribution: ask it, as Keras would.
        layout = distribution.get_variable_layout(variable)
        axes = tuple(layout.axes) if layout is not None else (None,) * rank
        return axes, "(from distribution)"
    keys = dict(variable_keys)
    if variable.path in keys:  # An exact key wins, as in Keras's LayoutMap.
        return checked(variable, keys[variable.path], variable.path), variable.path
    matching = [k for k, _ in variable_keys if re.fullmatch(k, variable.path)]
    if len(matching) > 1:
        raise ShardingError(
            f"Variable {variable.path!r} is matched by {len(matching)} "
            f"LayoutMap keys: {matching}. Each variable must resolve to one "
            "layout; make the keys exclusive (anchor or narrow the regexes)."
        )
    if matching:
        return checked(variable, keys[matching[0]], matching[0]), matching[0]
    return (None,) * rank, "(replicated)"


def checked(variable, axes, key):
    shape = tuple(variable.shape)
    if len(axes) != len(shape):
        raise ShardingError(
            f"The layout of LayoutMap key {key!r} has rank {len(axes)}, but "
            f"variable {variable.path!r} has rank {len(shape)}. Received: "
            f"axes={axes}, shape={shape}; give one axis (or None) per "
            "dimension."
        )
    return tuple(axes)


def reference_of(variable, references):
    """The model variable an optimizer slot was made from, or `None`.

    Keras names a slot `<reference path with / as _>_<slot name>` and gives it
    the reference's shape (`Optimizer.add_variable_from_reference`).
    """
    matching = [
        prefix
        for prefix, reference in references.items()
        if variable.name.startswith(prefix + "_")
        and tuple(variable.shape) == tuple(reference.shape)
    ]
    return references[max(matching, key=len)] if matching else None


def output_paths(model):
    """Every layer output path of the model, as Keras names it at call time."""
    layers = model._flatten_layers(include_self=True, recursive=True)
    paths = ((getattr(layer, "path", None) or layer.name) for layer in layers)
    return list(dict.fromkeys(path + OUTPUT_SUFFIX for path in paths))


def matches_path_or_suffix(key, path):
    if re.fullmatch(key, path):
        return True
    parts = path.split("/")
    return any(re.fullmatch(key, "/".join(parts[i:])) for i in range(1, len(parts)))


def resolve_outputs(model, output_keys):
    """`(key, output path, axes)` for each layer output an output key names."""
    paths = output_paths(model)
    outputs = []
    owner = {}
    for key, axes in output_keys:
        matched = [p for p in paths if re.fullmatch(key, p)]
        if not matched:
            matched = [p for p in paths if matches_path_or_suffix(key, p)]
            if len(matched) > 1:
                raise ShardingError(
                    f"Output key {key!r} matches {len(matched)} layers by path "
                    f"suffix: {matched}. Name one layer: use a longer suffix "
                    f"or the full path, e.g. {matched[0]!r}."
                )
        for path in matched:
            if path in owner:
                raise ShardingError(
                    f"Layer output {path!r} is matched by two LayoutMap keys: "
                    f"{[owner[path], key]}. Each output must resolve to one "
                    "layout; keep one of the keys."
                )
            owner[path] = key
            outputs.append((key, path, axes))
    return outputs


def warn_unmatched(layout_map, used_keys, model_vars, model):
    candidates = [v.path for v in model_vars] + output_paths(model)
    for key in layout_map:
        if key in used_keys:
            continue
        close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.3)
        warnings.warn(
            f"LayoutMap key {key!r} matches no variable and no layer output "
            f"of model {model.name!r}, so it has no effect. Closest paths: "
            f"{close or candidates[:3]}. Print `keras_parallel.describe(model)`"
            " or `[v.path for v in model.variables]` for every path.",
            UnmatchedLayoutKeyWarning,
            stacklevel=4,
        )
