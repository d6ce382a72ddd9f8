"""A model's class while an entry point runs: a backend's trainer mixin first.

Keras chooses each backend's training behaviour in the model's class
(`class Model(Trainer, base_trainer.Trainer, Layer)`); keras_parallel does
the same. For the span of an entry point the model's class becomes a subclass
of its own whose first base is the backend's mixin (`backends/<b>/trainer.py`),
so the mixin's methods come before the model's, a user's overrides included,
and reach them through `super()`. The subclass shows the model's own class as
`model.__class__`, which Keras's saving and `isinstance` read: what a run
writes is what it would write without keras_parallel.
"""

import operator
import weakref

from keras_parallel.replacements import target_of

#: `object`'s own `__class__`, which assigns past the mixin's property.
_CLASS_SLOT = object.__dict__["__class__"]

#: `{model's class: {mixin: subclass}}`, made once per pair.
_made = weakref.WeakKeyDictionary()


class TrainerMixin:
    """Base of the backends' trainer mixins.

    Its subclasses define the methods of Keras's trainer that a distributed
    model runs differently; `swap_class` puts one first in a model's bases.
    """

    #: The model's class without the mixin, set on each made subclass.
    _kp_plain_class = None

    # `type(model)` is the made subclass; `model.__class__` the model's own.
    # A C getter: Keras reads `__class__` on every call of the model, and a
    # Python one would add a frame to each.
    __class__ = property(
        operator.attrgetter("_kp_plain_class"),
        lambda self, value: _CLASS_SLOT.__set__(self, value),
    )


def attribute_of(holder, name):
    """A property reading `name` from the object at `model.<holder>`.

    Read in C (`operator.attrgetter`): the model's method is the holder's
    callable itself, with no frame between Keras and it.
    """
    return property(operator.attrgetter(f"{holder}.{name}"))


def trainer_class(cls, mixin):
    """The subclass of `cls` with `mixin` first, named and placed as `cls`.

    Args:
        cls: the model's own class.
        mixin: a `TrainerMixin` subclass.

    Returns:
        A class whose MRO is `mixin`, then `cls`'s.
    """
    made = _made.setdefault(cls, {})
    subclass = made.get(mixin)
    if subclass is None:
        subclass = type(
            cls.__name__,
            (mixin, cls),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_kp_plain_class": cls._kp_plain_class or cls
                if issubclass(cls, TrainerMixin)
                else cls,
            },
        )
        made[mixin] = subclass
    return subclass


def swap_class(model, mixin, names):
    """Makes `model` an object of `trainer_class(type(model), mixin)`.

    Attributes of `names` the model holds on itself (which would hide the
    mixin's methods) are set aside while the class is swapped.

    Args:
        model: the `keras.Model`.
        mixin: a `TrainerMixin` subclass.
        names: the methods `mixin` defines for the run.

    Returns:
        A function that puts back the model's class and attributes.

    Raises:
        LookupError: no `REPLACED` table lists `__class__` (a keras_parallel bug).
    """
    target_of(model, "__class__")
    plain = type(model)
    own = vars(model)
    kept = {name: own.pop(name) for name in names if name in own}
    _CLASS_SLOT.__set__(model, trainer_class(plain, mixin))

    def restore():
        _CLASS_SLOT.__set__(model, plain)
        vars(model).update(kept)

    return restore
