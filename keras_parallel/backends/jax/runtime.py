"""The multi-process JAX runtime, started from the environment.

It must start before the first device query, which fixes a one-process
runtime for good, so it starts as soon as Keras is imported.
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
    """`jax.distributed.initialize`'s arguments read from `environ` (default
    `os.environ`), or None unless it names several processes.

    Raises:
        ClusterEnvironmentError: a variable of the environment is wrong.
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

    CPU devices talk over gloo. JAX's own cluster detection is not used: it
    misses torchelastic and a plain Open MPI 5 `mpirun`. The wait for the
    others is bounded by `KERAS_PARALLEL_JOIN_TIMEOUT`: JAX's own would
    abort minutes later without naming a variable. Returns whether several
    processes run now.

    Raises:
        ClusterEnvironmentError: a variable of the environment is wrong, or
            process 0's port is taken.
    """
    import jax
    import keras  # First: importing it may start the runtime.

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
        # JAX's coordination service binds every interface (`[::]`) unless
        # told: the address the cluster gives the first process is the one
        # the others reach it at (a launcher's own choice is kept).
        os.environ.setdefault("JAX_COORDINATOR_BIND_ADDRESS", address)
    if CPU_COLLECTIVES_ENV not in os.environ:
        # JAX is imported already: set its config, not the environment.
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
        # `keras_compat` is half made (its import of Keras started the
        # runtime): a script's own call then gets JAX's error.
        return
    initialize_once.install()
