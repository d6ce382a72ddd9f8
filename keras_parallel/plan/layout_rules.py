"""Rules that place logical axes on mesh axes: an ordered list, first fit wins.

A rule `("mlp", "model")` splits a dimension of logical axis `"mlp"` over mesh
axis `"model"` where that axis divides it and no other dimension of the
variable uses it; a dimension no rule fits stays whole (as in MaxText).
"""

import warnings

from keras_parallel.errors import ShardingError
from keras_parallel.plan import logical_axes

AUTO = "auto"


def auto_rules(axis_names, batch_axis):
    """The default rules of a mesh: one model axis besides the batch axis.

    Vocabulary, MLP features and attention heads split over the model axis;
    key/value heads too where it divides them, else they stay whole (each
    device computes every one, at no more communication; splitting their head
    dimension would all-reduce every attention score). `embed` stays whole.

    Raises:
        ShardingError: the mesh has no axis, or several, besides the batch.
    """
    others = [name for name in axis_names if name != batch_axis]
    if len(others) != 1:
        raise ShardingError(
            '`rules="auto"` needs a mesh of two axes, the batch axis and one '
            f"model axis. Received: axis_names={list(axis_names)}, "
            f"batch_dim_name={batch_axis!r}; give a mesh such as "
            "DeviceMesh((2, 4), ['data', 'model']), or pass your own rules, "
            "e.g. rules=[('mlp', 'model'), ('heads', 'model')]."
        )
    model_axis = others[0]
    return (
        (logical_axes.VOCAB, model_axis),
        (logical_axes.MLP, model_axis),
        (logical_axes.HEADS, model_axis),
        (logical_axes.KV_HEADS, model_axis),
    )


def check_rules(rules):
    """Refuses rules that are not `"auto"` or `(logical axis, mesh axis or None)`
    pairs (`ShardingError`); returns `"auto"` or the pairs as a tuple."""
    if isinstance(rules, str):
        if rules != AUTO:
            raise ShardingError(
                f'`rules` must be "auto" or a list of (logical axis, mesh axis) '
                f'pairs. Received: rules={rules!r}; pass rules="auto".'
            )
        return AUTO
    if not isinstance(rules, (list, tuple)) or (
        len(rules) == 2 and all(isinstance(r, str) for r in rules)
    ):
        raise ShardingError(
            '`rules` must be "auto" or a list of (logical axis, mesh axis) '
            f"pairs. Received: rules={rules!r}; pass e.g. "
            "rules=[('mlp', 'model')] (a list, even of one rule)."
        )
    checked = []
    for rule in rules:
        if (
            not isinstance(rule, (tuple, list))
            or len(rule) != 2
            or not isinstance(rule[0], str)
            or not (rule[1] is None or isinstance(rule[1], str))
        ):
            raise ShardingError(
                "Each rule must be a (logical axis, mesh axis) pair of names, "
                f"the mesh axis a string or None. Received: {rule!r}; write it "
                "as e.g. ('mlp', 'model')."
            )
        checked.append(tuple(rule))
    return tuple(checked)


def rules_of(distribution, axis_names, batch_axis):
    """A distribution's rules, resolved for its mesh, or `None` if it has none.

    Raises:
        ShardingError: a rule names a mesh axis the mesh lacks.
    """
    rules = getattr(distribution, "rules", None)
    if rules is None:
        return None
    if rules == AUTO:
        return auto_rules(axis_names, batch_axis)
    for logical, mesh_axis in rules:
        if mesh_axis is not None and mesh_axis not in axis_names:
            raise ShardingError(
                f"Rule ({logical!r}, {mesh_axis!r}) names a mesh axis the "
                f"device mesh lacks. Received: mesh axis_names="
                f"{list(axis_names)}; use one of these names, or None to keep "
                f"{logical!r} whole."
            )
    return rules


def place(logical, shape, rules, sizes):
    """The mesh axes of one variable, and a note saying which rules chose them.

    Args:
        logical: the variable's `LogicalAxes`, or `None` (unknown layer).
        sizes: `{mesh axis: size}`.

    Returns:
        `(axes, note, misfits)`: one mesh axis (or `None`) per dimension, the
        note for the plan's key column, and `(logical axis, mesh axis,
        dimension)` for each rule that named a dimension it does not divide.
    """
    if logical is None:
        return (None,) * len(shape), "(no logical axes)", []
    axes, used, chosen, misfits = [], set(), [], []
    for name, size in zip(logical.names, shape, strict=True):
        axis = None
        for rule_name, mesh_axis in rules:
            if rule_name != name:
                continue
            if mesh_axis is None:
                break  # Kept whole on purpose.
            if mesh_axis in used:
                continue
            if size % int(sizes[mesh_axis]):
                misfits.append((name, mesh_axis, size))
                continue
            axis = mesh_axis
            used.add(mesh_axis)
            chosen.append(f"{name}->{mesh_axis}")
            break
        axes.append(axis)
    note = ", ".join(chosen) if chosen else "whole"
    for name, mesh_axis, size in misfits:
        note += f"; {mesh_axis} does not divide {name} {size}"
    return tuple(axes), f"(rules: {note})", misfits


class RulePlacement:
    """The rules placing one model's variables, for `plan.resolve_plan`."""

    def __init__(self, distribution, model, rules, batch_axis, sizes):
        self.model = model
        self.rules = rules
        self.batch_axis = batch_axis
        self.sizes = sizes
        self._users = None if distribution.rules == AUTO else rules
        self._logical = logical_axes.of_model(model)
        self._used = set()
        self._misfits = {}
        self._split_axes = set()

    @classmethod
    def of(cls, distribution, model, batch_axis, sizes):
        """The placement, or `None` for a distribution without rules."""
        rules = rules_of(distribution, tuple(sizes), batch_axis)
        if rules is None:
            return None
        return cls(distribution, model, rules, batch_axis, sizes)

    def place(self, variable):
        """`(axes, key, logical axis names or None)` of one model variable."""
        found = self._logical.get(variable.path)
        axes, key, misfits = place(found, tuple(variable.shape), self.rules, self.sizes)
        names = found.names if found is not None else None
        self._used.update((n, a) for n, a in zip(names or (), axes, strict=False) if a)
        if misfits:
            self._misfits[variable.path] = misfits
        return axes, key, names

    def saw(self, axes):
        """Notes the axes the plan gave a variable (a key's or the rules')."""
        self._split_axes.update(a for a in axes if a is not None)

    def warn_unused(self):
        """Warns of rules that place nothing, and of a model axis that splits nothing.

        `"auto"`'s rules are left out: they name axes a model may lack, such
        as `vocab` in an MLP. A model axis counts as used where any variable
        is split over it, by a rule or a `LayoutMap` key.
        """
        sizes, model = self.sizes, self.model
        for rule in self._users or ():
            if rule in self._used or rule[1] is None:
                continue
            named = [
                p for p, m in self._misfits.items() if any(f[:2] == rule for f in m)
            ]
            why = (
                f"it names {len(named)} variable(s) whose dimension "
                f"{rule[1]!r} (size {sizes[rule[1]]}) does not divide, e.g. "
                f"{named[0]!r}"
                if named
                else f"no variable of model {model.name!r} has logical axis {rule[0]!r}"
            )
            warnings.warn(
                f"Rule {rule!r} splits nothing: {why}. Print "
                "keras_parallel.describe(model, distribution) for each variable's "
                "logical axes; change or drop the rule.",
                stacklevel=3,
            )
        for name, size in sizes.items():
            if name == self.batch_axis or int(size) <= 1 or name in self._split_axes:
                continue
            warnings.warn(
                f"Mesh axis {name!r} (size {size}) splits no variable of "
                f"model {model.name!r}: its devices each hold every variable "
                "whole and compute the same. Give the axis a size that divides "
                "the model's dimensions (keras_parallel.describe shows them), "
                "or use keras_parallel.DataParallel().",
                stacklevel=3,
            )
