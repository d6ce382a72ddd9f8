"""The exceptions and warnings keras_parallel raises.

Every error says what was wrong, what was received, and what to do instead,
and is raised before anything is applied, so the model stays as it was.
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

    Raised when a backend's executor is first imported, naming the Keras
    version found, the internal it lacks and the supported range; see
    `keras_parallel.keras_compat`.
    """


class ClusterJoinError(RuntimeError):
    """keras_parallel could not join a cluster's processes when Keras was imported.

    Raised by the import of Keras (`keras_parallel.cluster_join`), the
    original error as its `__cause__`; its message offers
    `KERAS_PARALLEL_CLUSTER=off`. Raised again at each later import of
    Keras in the process: a failed join is not retried.
    """


class ShardingWarning(UserWarning):
    """A variable that `shard=` leaves whole although it is large."""
