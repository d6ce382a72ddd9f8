"""The exceptions and warnings keras_parallel raises.

Each error says what was wrong, what was received and what to do, and comes
before anything is applied.
"""


class ShardingError(ValueError):
    """A distribution that cannot be applied to this model as given.

    A `ValueError`, so code that already catches Keras's own distribution
    errors keeps working.
    """


class UnmatchedLayoutKeyWarning(UserWarning):
    """A `LayoutMap` key that matches no variable and no layer output."""


class UnsupportedKerasError(ImportError):
    """The installed Keras lacks an internal keras_parallel relies on.

    Raised at import, naming the version found and the internal (`keras_compat`).
    """


class ClusterJoinError(RuntimeError):
    """keras_parallel could not join a cluster's processes when Keras was imported.

    Raised by `import keras` (`cluster_join`), the original error as its
    `__cause__`, and again at each later import: a failed join is not retried.
    """


class ChiefWriteError(RuntimeError):
    """Process 0 failed to write the file a call writes (`model.save`,
    `save_weights`, a `ModelCheckpoint` in `fit`): raised by the same call
    on every other process, naming the file and process 0's error
    (`chief_writes`)."""


class ShardingWarning(UserWarning):
    """A variable that `shard=` leaves whole although it is large."""
