"""`KERAS_PARALLEL_CLUSTER=off`: keras_parallel reads no cluster variable."""

import os

from keras_parallel.cluster_environments.base import environment_error

#: Set to `off`, every process runs alone: no environment is detected, no
#: `TF_CONFIG` is acted on, nothing is joined when Keras is imported.
OPT_OUT_VAR = "KERAS_PARALLEL_CLUSTER"
_VALUES = ("", "auto", "off")


def opted_out(environ=None):
    """Whether `KERAS_PARALLEL_CLUSTER` is `off`.

    The way out when keras_parallel's cluster join is not wanted (a job
    that starts its runtime its own way) or fails while Keras is imported.

    Args:
        environ: the variables to read; `os.environ` when None.

    Returns:
        True for `off` (any case); False when unset, empty or `auto`.

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
