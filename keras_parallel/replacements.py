"""One way to replace an attribute of Keras (or of a backend) for a while.

keras_parallel reuses Keras's trainer, and a few things can only be changed
by replacing an attribute: a function of a Keras module, a method of a Keras
class, a method of one model object. Every such replacement goes through
`Replacements`, which

- refuses a target that is not listed in a table of replaced targets
  (`REPLACED` in `keras_parallel.keras_compat` and in each backend's
  `keras_compat`), so the tables list everything keras_parallel replaces;
- records what it found (the owner's own attribute, or that it had none and
  inherited one) and restores exactly that, in reverse order: a distributed
  model run inside another's `fit` (a callback that evaluates a second
  model) puts back the outer model's replacements, not Keras's originals.

Example:

```python
replacements = Replacements()
replacements.replace(keras_trainer_module, "jit", jit_without_donation)
try:
    ...
finally:
    replacements.restore()
```
"""

import contextlib
import importlib
import types

_MISSING = object()


class Target:
    """Attributes of Keras (or of a backend) that keras_parallel replaces.

    Args:
        owner: where the attributes live, as an import path: a module
            (`"keras.src.backend.jax.trainer"`) or a class
            (`"keras.src.callbacks.backup_and_restore.BackupAndRestore"`).
        names: the attributes' names (a string or a tuple of strings).
        why: what keras_parallel does with them, for the docs' table.
        on_instances: the attributes are set on objects of the `owner`
            class (a model's `train_step`), not on the class itself.
        optional: the owner (or the attributes) exist only in some Keras
            versions; another `Target` names where the others have them.
        shown_as: how the docs' table names `names`, where they are many.
    """

    def __init__(
        self, owner, names, why, on_instances=False, optional=False, shown_as=None
    ):
        self.owner = owner
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.why = why
        self.on_instances = on_instances
        self.optional = optional
        self.shown_as = shown_as
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
    """The module or class at a dotted path, or `None`.

    Walked by attribute from the top package, importing a submodule only
    where no attribute has the name: `"tensorflow.random"` is the module
    object `tf.random` that Keras calls, which an import by that name is not.
    """
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


def _registered_targets():
    """Every target of the shared table and of each imported backend's."""
    import sys

    from keras_parallel import keras_compat

    targets = list(keras_compat.REPLACED)
    for backend in ("jax", "torch", "tensorflow"):
        module = sys.modules.get(f"keras_parallel.backends.{backend}.keras_compat")
        if module is not None:
            targets += list(getattr(module, "REPLACED", ()))
    return targets


def target_of(owner, name):
    """The registered `Target` that `owner.name` is.

    Raises:
        LookupError: no table lists it (a keras_parallel bug: every
            replacement must be listed, see the module docstring).
    """
    for target in _registered_targets():
        if target.matches(owner, name):
            return target
    what = owner.__name__ if isinstance(owner, (type, types.ModuleType)) else owner
    raise LookupError(
        f"keras_parallel replaces {what!r}.{name} without listing it. "
        f"Received: owner={what!r}, name={name!r}; add a Target to REPLACED in "
        "keras_parallel/keras_compat.py or the backend's keras_compat.py."
    )


def _own(owner, name):
    """`owner`'s own value of `name` (not inherited), or `_MISSING`."""
    try:
        return vars(owner).get(name, _MISSING)
    except TypeError:  # No __dict__.
        return _MISSING


def _set(owner, name, value):
    if isinstance(owner, type):
        type.__setattr__(owner, name, value)
    elif isinstance(owner, types.ModuleType):
        setattr(owner, name, value)
    else:
        # Past Keras's and torch's attribute tracking: a function set on a
        # model is not a layer to track.
        object.__setattr__(owner, name, value)


def _delete(owner, name):
    if isinstance(owner, type):
        type.__delattr__(owner, name)
    elif isinstance(owner, types.ModuleType):
        delattr(owner, name)
    else:
        object.__delattr__(owner, name)


class Replacements:
    """Attributes replaced for a while; `restore()` puts back what was found.

    Re-entrant and stackable: each `Replacements` restores what it found
    when it replaced, so replacements made inside others' (a nested entry
    point) undo only their own.
    """

    def __init__(self):
        self._found = []

    def replace(self, owner, name, value):
        """Sets `owner.name = value`, remembering what `owner` had.

        Args:
            owner: a module, a class, or an object (a model, a layer).
            name: the attribute, listed in a `REPLACED` table.
            value: the replacement.

        Returns:
            What `owner.name` was (inherited or its own): the function a
            wrapper calls on.
        """
        target_of(owner, name)
        previous = getattr(owner, name, None)
        self._found.append((owner, name, _own(owner, name)))
        _set(owner, name, value)
        return previous

    def restore(self):
        """Puts back what every `replace` found, newest first."""
        while self._found:
            owner, name, found = self._found.pop()
            if found is not _MISSING:
                _set(owner, name, found)
            elif name in _own_keys(owner):
                _delete(owner, name)

    def __bool__(self):
        return bool(self._found)


def _own_keys(owner):
    try:
        return vars(owner)
    except TypeError:
        return {}


@contextlib.contextmanager
def replaced(items):
    """Replaces `{(owner, name): value}` while the block runs.

    Example:

    ```python
    with replaced({(keras_loss, "scale_loss_for_distribution"): scale}):
        ...
    ```
    """
    replacements = Replacements()
    try:
        for (owner, name), value in items.items():
            replacements.replace(owner, name, value)
        yield replacements
    finally:
        replacements.restore()


def markdown_rows(label, targets):
    """The rows of docs/design.md's table of replaced targets.

    Args:
        label: the first column: `"every backend"`, `"jax"`, ...
        targets: the `Target`s of that table.

    Returns:
        A list of Markdown table rows, one per target.
    """
    rows = []
    for target in targets:
        names = target.shown_as or ", ".join(f"`{name}`" for name in target.names)
        where = f"`{target.owner}`" + (" objects" if target.on_instances else "")
        rows.append(f"| {label} | {where} | {names} | {target.why} |")
    return rows
