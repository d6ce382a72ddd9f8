"""What keras_parallel replaces in Keras: a `Target`, one row of a table.

The `REPLACED` tables of each `keras_compat` are made of them; `replacements`
replaces only what they list, and docs/design.md shows them (`markdown_rows`).
"""

import importlib

_MISSING = object()


class Target:
    """Attributes of Keras (or of a backend) that keras_parallel replaces.

    Args:
        owner: the import path of a module or class holding the attributes.
        names: a string or a tuple of strings.
        why: what keras_parallel does with them, for the docs' table.
        on_instances: the attributes are set on objects of the `owner`
            class (a model's `train_step`), not on the class itself.
        optional: they exist only in some Keras versions; another `Target`
            names where the others have them.
    """

    def __init__(self, owner, names, why, on_instances=False, optional=False):
        self.owner = owner
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.why = why
        self.on_instances = on_instances
        self.optional = optional
        self._resolved = _MISSING

    def __repr__(self):
        where = f"{self.owner} objects" if self.on_instances else self.owner
        return f"Target({where}: {', '.join(self.names)})"

    def resolve_owner(self):
        """The module or class named by `owner`, or `None` if it is missing."""
        if self._resolved is _MISSING:
            self._resolved = _import(self.owner)
        return self._resolved

    def matches(self, owner, name):
        """Whether replacing `owner.name` is replacing one of these."""
        if name not in self.names:
            return False
        resolved = self.resolve_owner()
        if resolved is None:
            return False
        if self.on_instances:
            return isinstance(owner, resolved) and not isinstance(owner, type)
        return owner is resolved


def _import(path):
    """The module or class at a dotted path, or `None`, walked by attribute:
    `"tensorflow.random"` is the `tf.random` Keras calls, not that import."""
    parts = path.split(".")
    try:
        value = importlib.import_module(parts[0])
    except ImportError:
        return None
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(value, part):
            value = getattr(value, part)
            continue
        try:
            value = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            return None
    return value


def markdown_rows(label, targets):
    """docs/design.md's Markdown table rows, one per `Target` of `targets`.

    Args:
        label: the first column: `"every backend"`, `"jax"`, ...
    """
    rows = []
    for target in targets:
        names = ", ".join(f"`{name}`" for name in target.names)
        where = f"`{target.owner}`" + (" objects" if target.on_instances else "")
        rows.append(f"| {label} | {where} | {names} | {target.why} |")
    return rows
