"""A distributed model's class: its own, with keras_parallel's mixins first.

Keras chooses each backend's training behaviour in the model's class
(`class Model(Trainer, base_trainer.Trainer, Layer)`); keras_parallel does
the same. While a behaviour is in force (a backend's trainer while an entry
point runs, `backends/<b>/trainer.py`; a non-chief process's saving for the
model's distributed life, `chief.py`) the model's class is a subclass of its
own whose first bases are those mixins, newest first: their methods come
before the model's, a user's overrides included, and reach them through
`super()`. The subclass shows the model's own class as `model.__class__`,
which Keras's saving and `isinstance` read: what a run writes is what it
would write without keras_parallel.
"""

import operator
import weakref

from keras_parallel.replacements import target_of

#: `object`'s own `__class__`, which assigns past the mixin's property.
_CLASS_SLOT = object.__dict__["__class__"]

#: `{model's class: {mixins: weak reference to the subclass}}`: made once
#: per class and mixins, and released with the last model of it (a made
#: subclass holds its class, so a strong value would keep its own key).
_made = weakref.WeakKeyDictionary()


class TrainerMixin:
    """Base of keras_parallel's model mixins.

    Its subclasses define the methods of Keras's model that a distributed
    model runs differently; `swap_class` puts one first in a model's bases.
    """

    #: The model's class without the mixins, set on each made subclass.
    _kp_plain_class = None

    # `type(model)` is the made subclass; `model.__class__` the model's own.
    # A C getter: Keras reads `__class__` on every call of the model, and a
    # Python one would add a frame to each.
    __class__ = property(
        operator.attrgetter("_kp_plain_class"),
        lambda self, value: _CLASS_SLOT.__set__(self, value),
    )

    def __reduce__(self):
        # Keras pickles a model as `(type(model)._unpickle_model, (file,))`;
        # pickle names a class by module and name, and finds the model's
        # own class there, not this made one: name the model's own.
        load, args = super().__reduce__()[:2]
        if getattr(load, "__self__", None) is type(self):
            load = getattr(self._kp_plain_class, load.__name__)
        return load, args


def attribute_of(holder, name):
    """A property reading `name` from the object at `model.<holder>`.

    Read in C (`operator.attrgetter`): the model's method is the holder's
    callable itself, with no frame between Keras and it.
    """
    return property(operator.attrgetter(f"{holder}.{name}"))


def trainer_class(cls, mixins):
    """The subclass of `cls` with `mixins` first, named and placed as `cls`.

    Args:
        cls: the model's own class.
        mixins: a tuple of `TrainerMixin` subclasses, the first first.

    Returns:
        A class whose MRO is `mixins`', then `cls`'s.
    """
    made = _made.setdefault(cls, {})
    kept = made.get(mixins)
    subclass = None if kept is None else kept()
    if subclass is None:
        subclass = type(
            cls.__name__,
            (*mixins, cls),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_kp_plain_class": cls,
            },
        )
        made[mixins] = weakref.ref(subclass)
    return subclass


def names_of(mixin):
    """The attributes `mixin` defines (its classes' below `TrainerMixin`):
    what a model holding the same names on itself would hide.

    Args:
        mixin: a `TrainerMixin` subclass.

    Returns:
        A tuple of names, the mixin's own first.
    """
    names = []
    for cls in mixin.__mro__:
        if cls is TrainerMixin or not issubclass(cls, TrainerMixin):
            break
        names += [n for n in vars(cls) if not (n.startswith("__") and n.endswith("__"))]
    return tuple(dict.fromkeys(names))


def swap_class(model, mixin, **state):
    """Puts `mixin` first in `model`'s class until the returned function runs.

    The swaps of one model may end in any order: each leaves the class made
    of the mixins still in force, and what the model holds on itself under
    a mixin's names (`names_of`), which would hide the mixin's, stays set
    aside while any mixin in force defines the name.

    Args:
        model: the `keras.Model`.
        mixin: a `TrainerMixin` subclass.
        **state: attributes set on the model meanwhile, for the mixin to read
            (`_kp_` names: past Keras's and torch's tracking).

    Returns:
        A function that ends the swap (safe to call twice).

    Raises:
        LookupError: no `REPLACED` table lists `__class__` (a keras_parallel bug).
    """
    target_of(model, "__class__")
    own = vars(model)
    swaps = own.setdefault("_kp_swaps", [])
    set_aside = own.setdefault("_kp_set_aside", {})
    plain = type(model)._kp_plain_class if swaps else type(model)
    set_aside.update({n: own.pop(n) for n in names_of(mixin) if n in own})
    swap = (mixin, state)
    swaps.append(swap)
    own.update(state)
    _set_class(model, plain)

    def restore():
        if not any(s is swap for s in swaps):
            return
        swaps[:] = [s for s in swaps if s is not swap]
        for key in state:
            own.pop(key, None)
        for _, kept_state in swaps:  # Another swap's of the same names.
            own.update(kept_state)
        in_force = {n for m, _ in swaps for n in names_of(m)}
        for name in [n for n in set_aside if n not in in_force]:
            own[name] = set_aside.pop(name)
        _set_class(model, plain)
        if not swaps:
            del own["_kp_swaps"], own["_kp_set_aside"]

    return restore


class HeldSwap:
    """A swap held longer than one entry point (a model's distributed
    life, a callback's run): put in force once, ended once.

    Example:

    ```python
    saving = HeldSwap()
    saving.hold(lambda: swap_class(model, ChiefOnlySaving))
    saving.hold(lambda: swap_class(model, ChiefOnlySaving))  # Held: nothing.
    saving.end()
    ```
    """

    def __init__(self):
        self._end = None

    def hold(self, swap):
        """Calls `swap()` (which puts a swap in force and returns the function
        that ends it) unless a swap is held already."""
        if self._end is None:
            self._end = swap()

    def end(self):
        """Ends the held swap, if any (safe to call twice)."""
        end, self._end = self._end, None
        if end is not None:
            end()


def _set_class(model, plain):
    swaps = vars(model).get("_kp_swaps")
    # A mixin in force twice (two `ShardingCallback`s' plans on one model)
    # is one base, where its newest swap puts it; the newest state holds.
    mixins = tuple(dict.fromkeys(mixin for mixin, _ in reversed(swaps or ())))
    _CLASS_SLOT.__set__(model, trainer_class(plain, mixins) if mixins else plain)
