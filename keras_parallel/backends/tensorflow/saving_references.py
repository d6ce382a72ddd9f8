"""Keras's saving inside a `tf.distribute` strategy, its reference objects made outside.

A save from a callback during `fit` runs on worker 0 alone, inside the scope.
"""

import contextlib

from keras_parallel.backends.tensorflow.keras_compat import saving_lib
from keras_parallel.keras_seam.replacements import replaced

#: The kinds of objects Keras's saving builds a reference object of.
_SAVED_KINDS = (
    "Operation",
    "Layer",
    "Functional",
    "Sequential",
    "Metric",
    "Optimizer",
    "Loss",
)
_skipsets = {}


@contextlib.contextmanager
def made_outside():
    """Keras's saving, with its reference objects made before this scope.

    Each save builds an `Optimizer(1.0)`, a `Metric`, ... to learn which
    attributes to skip (Keras's cache is read under another key than it is
    written). Inside a strategy on worker 0 alone, their variables are made
    by a collective the other workers never join ("Collective instance ...
    expected type 0 ... but got type 1"), so this learns them once, outside.
    """
    original = saving_lib.get_attr_skipset
    for kind in _SAVED_KINDS:
        if kind not in _skipsets:
            _skipsets[kind] = original(kind)

    def learned(kind):
        return _skipsets[kind] if kind in _skipsets else original(kind)

    with replaced({(saving_lib, "get_attr_skipset"): learned}):
        yield
