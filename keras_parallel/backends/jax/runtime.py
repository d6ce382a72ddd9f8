"""The multi-process JAX runtime, started from the environment.

`keras-parallel launch` (or a cluster's own launcher) gives each process the
variables `keras.distribution.initialize()` reads
(`KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES`,
`KERAS_DISTRIBUTION_PROCESS_ID`); `initialize_from_environment` calls it
before the user's script runs, so the script needs no extra line. Keras's
`initialize` starts `jax.distributed` (its coordinator on process 0) and
agrees a random seed across processes.
"""

import os

#: The variables `keras.distribution.initialize()` reads.
ADDRESS_ENV = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
COUNT_ENV = "KERAS_DISTRIBUTION_NUM_PROCESSES"
ID_ENV = "KERAS_DISTRIBUTION_PROCESS_ID"


def wanted():
    """Whether the environment asks for more than one JAX process."""
    return int(os.environ.get(COUNT_ENV, "1") or 1) > 1


def initialize_from_environment():
    """Starts `jax.distributed` as the environment says, once.

    CPU devices talk over gloo (JAX's CPU collectives), so several processes
    also work on a machine without accelerators.

    Returns:
        True if several processes run now.
    """
    if not wanted():
        return False
    os.environ.setdefault("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
    import jax
    import keras

    # Asking for devices would start a one-process runtime: ask the client.
    if not jax.distributed.is_initialized():
        keras.distribution.initialize()
    return jax.process_count() > 1
