"""The multi-process JAX runtime, started from the environment.

`initialize_from_environment` starts `jax.distributed` through
`keras.distribution.initialize()` with what `cluster_environments` reads
from the launcher's variables. It must run before the first device query,
which fixes a one-process runtime for good, so it runs as soon as Keras is
imported, and under `keras-parallel launch` before the script too.
"""

import os

from keras_parallel import cluster_environments
from keras_parallel.cluster_environments import join_deadline

#: The variables `keras.distribution.initialize()` reads.
ADDRESS_ENV = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
COUNT_ENV = "KERAS_DISTRIBUTION_NUM_PROCESSES"
ID_ENV = "KERAS_DISTRIBUTION_PROCESS_ID"
#: JAX's variable for its CPU collectives; a value the user set is kept.
CPU_COLLECTIVES_ENV = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"


def cluster_arguments(environ=None):
    """`jax.distributed.initialize`'s arguments, where several processes run.

    Args:
        environ: the variables to read; `os.environ` when None.

    Returns:
        `{"coordinator_address", "num_processes", "process_id"}` computed
        from the detected cluster environment, or None where none is
        detected or it names one process.

    Raises:
        ClusterEnvironmentError: a variable of the environment is wrong; it
            is named.
    """
    env = cluster_environments.detect_cluster_environment(environ)
    if env is None or env.world_size() <= 1:
        return None
    return cluster_environments.jax_initialize_arguments(env)


def wanted(environ=None):
    """Whether the environment asks for more than one JAX process."""
    return cluster_arguments(environ) is not None


def initialize_from_environment():
    """Starts `jax.distributed` as the environment says, once.

    CPU devices talk over gloo (JAX's CPU collectives), so several processes
    also work on a machine without accelerators. The arguments are
    keras_parallel's, not JAX's own cluster detection: JAX finds SLURM's and
    Open MPI's (from `OMPI_MCA_orte_hnp_uri`, which a plain `mpirun` of
    Open MPI 5 does not set) on ports of its own choosing, and not
    torchelastic's; ours are the same in every case and for every backend.
    JAX still restricts each process to its local rank's GPU under SLURM
    (`local_device_ids`), as its own `initialize()` does.

    Process 0 first checks that the coordinator's port is free, and every
    process waits for the others at most `KERAS_PARALLEL_JOIN_TIMEOUT`
    seconds (`join_deadline`): JAX's own wait would abort the process
    minutes later without naming a variable.

    Returns:
        True if several processes run now.

    Raises:
        ClusterEnvironmentError: a variable of the environment is wrong, or
            process 0's port is taken.
    """
    import jax
    import keras  # First: importing it may start the runtime (see above).

    # Asking for devices would start a one-process runtime: ask the client.
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    env = cluster_environments.detect_cluster_environment()
    if env is None or env.world_size() <= 1:
        return False
    arguments = cluster_environments.jax_initialize_arguments(env)
    address = arguments["coordinator_address"]
    if arguments["process_id"] == 0:
        join_deadline.check_port_free(env, address)
    if CPU_COLLECTIVES_ENV not in os.environ:
        # JAX is imported already (by Keras): its flag is read when its
        # backend starts, so set through its config, not the environment.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with join_deadline.join_deadline(env, address):
        keras.distribution.initialize(
            job_addresses=address,
            num_processes=arguments["num_processes"],
            process_id=arguments["process_id"],
        )
    _accept_the_scripts_own_call()
    return jax.process_count() > 1


def _accept_the_scripts_own_call():
    """A later `keras.distribution.initialize()` of the script's, agreeing, runs."""
    try:
        from keras_parallel.backends.jax import initialize_once
    except ImportError:
        # The backend's `keras_compat` is half made: its own import of Keras
        # started the runtime. A script's own call then gets JAX's error.
        return
    initialize_once.install()
