"""The cluster a process was started in, read from its environment.

On a cluster the scheduler starts the processes (`srun python train.py`,
`mpirun -n 8 python train.py`, a Kubernetes job), and each learns its place
from the variables the launcher sets. One class per launcher reads them, in
Lightning's shape (`detect()`, `world_size()`, `global_rank()`,
`local_rank()`, `node_rank()`, `main_address()`, `main_port()`):

- `KerasDistributionEnvironment`: Keras's own `KERAS_DISTRIBUTION_*`
  (`keras.distribution.initialize`; `keras-parallel launch --backend jax`);
- `TorchElasticEnvironment`: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
  `MASTER_PORT` (torchrun, a Kubeflow PyTorchJob);
- `SlurmEnvironment`: a task of an `srun` step (`SLURM_PROCID`,
  `SLURM_STEP_NUM_TASKS`, ...; an `sbatch` script or `salloc` shell is one
  process);
- `OpenMPIEnvironment`: `mpirun` (`OMPI_COMM_WORLD_*`).

`detect_cluster_environment()` returns the first that applies, in that
order (an explicit setting wins over what a launcher around it set), or
None on a bare machine. `environment_variables(env, backend)` turns one
into what each backend's runtime reads: torch's `RANK`... `MASTER_PORT`,
the `KERAS_DISTRIBUTION_*` that become `jax.distributed.initialize`'s
arguments, TensorFlow's `TF_CONFIG`.

`KERAS_PARALLEL_CLUSTER=off` turns detection off: every process runs
alone (`opted_out`).

A value that cannot be right (a rank out of range, a world size below 1, no
address) raises `ClusterEnvironmentError` naming the variable to fix, when
it is read. A ground-layer module: it imports neither Keras nor a backend,
so the launcher and `keras-parallel env` can use it.
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

ENVIRONMENTS = (
    KerasDistributionEnvironment,
    TorchElasticEnvironment,
    SlurmEnvironment,
    OpenMPIEnvironment,
)


def detect_cluster_environment(environ=None):
    """The environment this process was started in, or None on a bare machine.

    Args:
        environ: the variables to read; `os.environ` when None.

    Returns:
        An instance of the first of `ENVIRONMENTS` whose `detect()` is true
        (not yet validated: `validate()` reads every value), or None; None
        too where `KERAS_PARALLEL_CLUSTER=off` (`opted_out`).

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
    """The plan's line: the environment joined by, else the one detected now.

    Never raises.
    """
    env = joined_environment()
    if env is None:
        return describe_environment()
    try:
        return env.describe()
    except ClusterEnvironmentError as error:
        return f"{env.name}, misconfigured: {error}"


def describe_environment(environ=None):
    """`keras-parallel env`'s line: the detected environment, or none.

    Never raises: a wrong variable is reported with its error.
    """
    try:
        if opted_out(environ):
            return f"none: {OPT_OUT_VAR}=off (every process runs alone)"
    except ClusterEnvironmentError as error:
        return f"misconfigured: {error}"
    env = detect_cluster_environment(environ)
    if env is None:
        return "none (a bare machine: use keras-parallel launch)"
    try:
        return env.describe()
    except ClusterEnvironmentError as error:
        return f"{env.name}, misconfigured: {error}"
