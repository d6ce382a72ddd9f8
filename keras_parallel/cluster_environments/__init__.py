"""The cluster a process was started in, read from its environment.

One class per launcher, in Lightning's shape (`detect()`, `global_rank()`, ...);
`detect_cluster_environment()` returns the first that applies. It imports
neither Keras nor a backend, so the launcher and `keras-parallel env` can use it.
"""

from keras_parallel.cluster_environments.base import (
    ClusterEnvironment,
    ClusterEnvironmentError,
)
from keras_parallel.cluster_environments.engine_variables import (
    BACKENDS,
    environment_variables,
    jax_initialize_arguments,
)
from keras_parallel.cluster_environments.keras_distribution import (
    KerasDistributionEnvironment,
)
from keras_parallel.cluster_environments.nodelists import (
    expand_nodelist,
    expand_tasks_per_node,
)
from keras_parallel.cluster_environments.openmpi import OpenMPIEnvironment
from keras_parallel.cluster_environments.opt_out import OPT_OUT_VAR, opted_out
from keras_parallel.cluster_environments.slurm import (
    NotStartedBySrunWarning,
    SlurmEnvironment,
)
from keras_parallel.cluster_environments.torchelastic import TorchElasticEnvironment

__all__ = [
    "BACKENDS",
    "ENVIRONMENTS",
    "OPT_OUT_VAR",
    "ClusterEnvironment",
    "ClusterEnvironmentError",
    "KerasDistributionEnvironment",
    "NotStartedBySrunWarning",
    "OpenMPIEnvironment",
    "SlurmEnvironment",
    "TorchElasticEnvironment",
    "describe_environment",
    "describe_joined",
    "detect_cluster_environment",
    "environment_variables",
    "expand_nodelist",
    "expand_tasks_per_node",
    "jax_initialize_arguments",
    "joined_environment",
    "opted_out",
    "record_joined",
]

# Detection order: an explicit setting (Keras's variables) beats a launcher's.
ENVIRONMENTS = (
    KerasDistributionEnvironment,
    TorchElasticEnvironment,
    SlurmEnvironment,
    OpenMPIEnvironment,
)


def detect_cluster_environment(environ=None):
    """The environment this process was started in, or None on a bare machine.

    Returns:
        An instance of the first of `ENVIRONMENTS` whose `detect()` is true,
        not yet validated; None where none is or `KERAS_PARALLEL_CLUSTER=off`.

    Raises:
        ClusterEnvironmentError: `KERAS_PARALLEL_CLUSTER` is neither `off`
            nor `auto`.
    """
    if opted_out(environ):
        return None
    for environment in ENVIRONMENTS:
        if environment.detect(environ):
            return environment(environ)
    return None


#: The environment this process joined by (`record_joined`), if it did.
_joined = []


def record_joined(env):
    """Remembers the environment a backend joined the other processes by.

    Read back for the plan's `Cluster:` line: after torch's variables are
    filled from `srun`'s, detecting again would name torchelastic.
    """
    _joined[:] = [env]


def joined_environment():
    """The environment `record_joined` kept, or None."""
    return _joined[0] if _joined else None


def describe_joined():
    """The plan's line (never raises): the environment joined by, else detected."""
    env = joined_environment()
    return describe_environment() if env is None else _describe(env)


def describe_environment(environ=None):
    """`keras-parallel env`'s line (never raises): the detected environment."""
    try:
        if opted_out(environ):
            return f"none: {OPT_OUT_VAR}=off (every process runs alone)"
    except ClusterEnvironmentError as error:
        return f"misconfigured: {error}"
    env = detect_cluster_environment(environ)
    if env is None:
        return "none (a bare machine: use keras-parallel launch)"
    return _describe(env)


def _describe(env):
    try:
        return env.describe()
    except ClusterEnvironmentError as error:
        return f"{env.name}, misconfigured: {error}"
