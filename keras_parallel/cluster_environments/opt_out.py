"""`KERAS_PARALLEL_CLUSTER=off`: keras_parallel reads no cluster variable."""

import os

from keras_parallel.cluster_environments.base import environment_error

#: Set to `off`, every process runs alone: nothing is detected or joined.
OPT_OUT_VAR = "KERAS_PARALLEL_CLUSTER"
_VALUES = ("", "auto", "off")


def opted_out(environ=None):
    """Whether `KERAS_PARALLEL_CLUSTER` is `off` (any case), not unset or `auto`.

    The way out where the cluster join is not wanted (a job that starts its
    runtime its own way) or fails while Keras is imported.

    Raises:
        ClusterEnvironmentError: any other value, which could be a typo of
            `off`.
    """
    environ = os.environ if environ is None else environ
    value = (environ.get(OPT_OUT_VAR) or "").strip().lower()
    if value not in _VALUES:
        raise environment_error(
            f"{OPT_OUT_VAR} must be 'off' or 'auto'",
            f"{OPT_OUT_VAR}={environ.get(OPT_OUT_VAR)!r}",
            f"set {OPT_OUT_VAR}=off to run each process alone, or unset it",
        )
    return value == "off"
