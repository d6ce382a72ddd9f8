"""A model's methods, run differently while a part of keras_parallel is in force.

Keras chooses a model's training behaviour by its methods (`train_step`,
`save`, `_symbolic_build`, ...); keras_parallel changes a few of them for as
long as a behaviour is in force: a backend's steps while an entry point runs
(`backends/torch/steps.py`), whole-file saving (`persistence/atomic.py`), a
non-chief process's saving for the model's distributed life (`run/chief.py`).
An `Overrides` object holds the methods; `override` puts them on the model
itself, among its own attributes, where Python looks before the model's
class. The class is never changed: `type(model) is model.__class__`, and what
Keras saves, pickles and reads of the model is what it would be without
keras_parallel.

Several overrides may be in force at once, the newest first; each reaches
the method it hides through `self.overridden` (another override's, or the
model's own), as a subclass would through `super()`.
"""

from keras_parallel.keras_seam.model_state import state_of
from keras_parallel.keras_seam.replacements import target_of


class Overrides:
    """Base of the objects whose methods a model runs while they are in force.

    A subclass lists the model's methods it replaces in `names`, and defines
    each (a method, or an attribute holding a callable). While in force,
    `self.overridden.<name>` is the method it hides.

    Example:

    ```python
    class Logged(Overrides):
        names = ("save",)

        def save(self, *args, **kwargs):
            print("saving")
            return self.overridden.save(*args, **kwargs)

    undo = override(model, Logged())
    model.save("model.keras")  # prints "saving", then Keras's own save
    undo()
    ```
    """

    #: The names of the model's methods this object replaces.
    names = ()

    #: The methods this object hides, while it is in force (`Overridden`).
    overridden = None

    #: The model this object is in force on.
    model = None


class Overridden:
    """The methods an `Overrides` hides, by name (`overridden.save(...)`)."""

    def __init__(self, methods):
        self.__dict__.update(methods)


def override(model, overrides):
    """Puts `overrides`' methods on `model` until the returned function runs.

    The overrides of one model may end in any order: each leaves those still
    in force. What the model holds on itself under the same names (a method
    assigned to the instance) is set aside while any override in force
    replaces the name, and put back after. Two overrides of one class in
    force at once count once, where the newest puts it: the newest object's
    methods are the model's.

    Args:
        model: the `keras.Model`.
        overrides: an `Overrides`.

    Returns:
        A function that ends the override (safe to call twice).

    Raises:
        LookupError: a name no `REPLACED` table lists for models (a
            keras_parallel bug), or `model` is not a `keras.Model`.
    """
    for name in overrides.names:
        target_of(model, name)
    overrides.model = model
    state = state_of(model)
    state.overrides.append(overrides)
    _put_in_force(model, state)

    def end():
        if not any(o is overrides for o in state.overrides):
            return
        state.overrides[:] = [o for o in state.overrides if o is not overrides]
        _put_in_force(model, state)

    return end


def in_force(model):
    """The overrides in force on `model`, the newest first."""
    return tuple(reversed(_effective(state_of(model).overrides)))


def _effective(stack):
    # One object per class, at the place of its newest: the oldest first.
    newest = {}
    for position, overrides in enumerate(stack):
        newest[type(overrides)] = position
    return [o for p, o in enumerate(stack) if newest[type(o)] == p]


def _put_in_force(model, state):
    own = vars(model)
    for name in state.installed:
        own.pop(name, None)
    effective = _effective(state.overrides)
    names = {n for o in effective for n in o.names}
    # The model's own instance attributes under these names, aside.
    state.set_aside.update({n: own.pop(n) for n in names if n in own})
    for name in [n for n in state.set_aside if n not in names]:
        own[name] = state.set_aside.pop(name)
    installed = {}
    for overrides in effective:
        hidden = {}
        for name in overrides.names:
            hidden[name] = installed.get(name) or getattr(model, name, None)
        overrides.overridden = Overridden(hidden)
        for name in overrides.names:
            installed[name] = getattr(overrides, name)
    own.update(installed)
    state.installed = tuple(installed)


class HeldOverride:
    """An override held longer than one entry point (a model's distributed
    life, a callback's run): put in force once, ended once.

    Example:

    ```python
    saving = HeldOverride()
    saving.hold(lambda: override(model, ChiefOnlySaving(None, None)))
    saving.hold(lambda: override(model, ChiefOnlySaving(None, None)))  # Held.
    saving.end()
    ```
    """

    def __init__(self):
        self._end = None

    def hold(self, start):
        """Calls `start()` (which puts an override in force and returns the
        function that ends it) unless one is held already."""
        if self._end is None:
            self._end = start()

    def end(self):
        """Ends the held override, if any (safe to call twice)."""
        end, self._end = self._end, None
        if end is not None:
            end()
