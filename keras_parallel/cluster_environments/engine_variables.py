"""What each backend's runtime reads, computed from a detected environment."""

import json

from keras_parallel.cluster_environments.base import host_port
from keras_parallel.cluster_environments.keras_distribution import (
    KerasDistributionEnvironment,
)
from keras_parallel.cluster_environments.torchelastic import TorchElasticEnvironment

BACKENDS = ("torch", "jax", "tensorflow")


def jax_coordinator_port(env):
    """The port of JAX's coordinator for `env`: `env.main_port()`.

    Under torchrun its agent holds `MASTER_PORT` (its TCPStore) for the whole
    run, so the coordinator takes `MASTER_PORT + 1`.
    """
    port = env.main_port()
    return port + 1 if isinstance(env, TorchElasticEnvironment) else port


def jax_initialize_arguments(env):
    """`jax.distributed.initialize`'s keyword arguments for `env`."""
    return {
        "coordinator_address": host_port(env.main_address(), jax_coordinator_port(env)),
        "num_processes": env.world_size(),
        "process_id": env.global_rank(),
    }


def environment_variables(env, backend):
    """The variables `backend`'s runtime reads, as strings; nothing is set.

    The runtimes read them as they read what `keras-parallel launch` sets:
    torch's process-group variables, `KERAS_DISTRIBUTION_*` for JAX, and
    `TF_CONFIG` for TensorFlow.

    Raises:
        ClusterEnvironmentError: a variable of `env` is wrong; it is named.
    """
    if backend == "torch":
        variables = {
            "RANK": str(env.global_rank()),
            "WORLD_SIZE": str(env.world_size()),
            "MASTER_ADDR": env.main_address(),
            "MASTER_PORT": str(env.main_port()),
        }
        local = env.local_rank()
        if local is not None:
            variables["LOCAL_RANK"] = str(local)
        return variables
    if backend == "jax":
        arguments = jax_initialize_arguments(env)
        keras = KerasDistributionEnvironment
        return {
            keras.ADDRESSES_VAR: arguments["coordinator_address"],
            keras.WORLD_SIZE_VAR: str(arguments["num_processes"]),
            keras.RANK_VAR: str(arguments["process_id"]),
        }
    if backend == "tensorflow":
        config = {
            "cluster": {"worker": env.worker_addresses()},
            "task": {"type": "worker", "index": env.global_rank()},
        }
        return {"TF_CONFIG": json.dumps(config)}
    raise ValueError(
        f"backend must be one of {', '.join(BACKENDS)}. Received: "
        f"backend={backend!r}; pass one of those."
    )
