"""One way to replace an attribute of Keras (or of a backend) for a while.

`Replacements` refuses a target that no `REPLACED` table lists, so the tables
list everything keras_parallel replaces, and restores exactly what it found,
newest first (docs/design.md).
"""

import contextlib
import types

from keras_parallel.keras_seam import keras_compat
from keras_parallel.keras_seam.replacement_targets import Target

__all__ = ["Replacements", "Target", "replaced", "target_of"]

_MISSING = object()


def _registered_targets():
    """Every target of the shared table and of each imported backend's."""
    import sys

    # Not made yet while `keras_compat` imports Keras (the torch backend
    # replaces a target as Keras loads); none of its targets is replaced then.
    targets = list(getattr(keras_compat, "REPLACED", ()))
    for backend in ("jax", "torch", "tensorflow"):
        module = sys.modules.get(f"keras_parallel.backends.{backend}.keras_compat")
        if module is not None:
            targets += list(getattr(module, "REPLACED", ()))
    return targets


def target_of(owner, name):
    """The registered `Target` that `owner.name` is.

    Raises:
        LookupError: no table lists it (a keras_parallel bug).
    """
    for target in _registered_targets():
        if target.matches(owner, name):
            return target
    what = owner.__name__ if isinstance(owner, (type, types.ModuleType)) else owner
    raise LookupError(
        f"keras_parallel replaces {what!r}.{name} without listing it. "
        f"Received: owner={what!r}, name={name!r}; add a Target to REPLACED in "
        "keras_parallel/keras_seam/keras_compat.py or the backend's keras_compat.py."
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
        # Past Keras's and torch's attribute tracking: a function is no layer.
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

    Each restores only its own, so they nest (a nested entry point).
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
            What `owner.name` was (inherited or its own), for a wrapper to call.
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
