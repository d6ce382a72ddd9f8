"""Joining a cluster's other processes once Keras is imported (JAX, TensorFlow).

`join` runs inside the user's `import keras`: cheap where no cluster is wanted,
loud where a join fails (`ClusterJoinError`, raised again at each later
import). The rules are in docs/design.md.
"""

import os
import sys

from keras_parallel import cluster_environments
from keras_parallel.errors import ClusterJoinError

#: Set by a join to the joined process's id; inherited by its children.
JOINED_PID_VAR = "KERAS_PARALLEL_JOINED_PID"

#: The join's error, raised again by every later `join`.
_failure = None


def join(backend):
    """Joins this process to the others of its cluster job, once.

    Args:
        backend: Keras's backend name; only `"jax"` and `"tensorflow"` join
            here (torch starts its process group at its first entry point).

    Returns:
        `(rank, world_size)` where this process joined several, else None.

    Raises:
        ClusterJoinError: the join failed, now or at an earlier call.
    """
    global _failure
    if _failure is not None:
        raise _failure
    try:
        placed = _JOINS.get(backend, lambda: None)() if may_join() else None
    except Exception as error:
        _failure = _join_error(error)
        raise _failure from error
    if placed is not None:
        install_excepthook(*placed)
    return placed


def may_join(environ=None):
    """Whether this process may join a cluster from its variables (`environ`,
    default `os.environ`): not where `KERAS_PARALLEL_CLUSTER=off`, in a
    `multiprocessing` child, nor where `KERAS_PARALLEL_JOINED_PID` names
    another process.

    Raises:
        ClusterEnvironmentError: `KERAS_PARALLEL_CLUSTER` is neither `off`
            nor `auto`.
    """
    import multiprocessing

    environ = os.environ if environ is None else environ
    if cluster_environments.opted_out(environ):
        return False
    if multiprocessing.parent_process() is not None:
        return False
    joined = (environ.get(JOINED_PID_VAR) or "").strip()
    return not joined or joined == str(os.getpid())


def _mark_joined():
    # In the environment, so that every child started from now inherits it.
    os.environ[JOINED_PID_VAR] = str(os.getpid())


def _join_jax():
    # `runtime` imports nothing else of the backend, which may be half made.
    from keras_parallel.backends.jax import runtime

    arguments = runtime.cluster_arguments()
    if arguments is None:
        return None
    _mark_joined()
    if not runtime.initialize_from_environment():
        return None
    return arguments["process_id"], arguments["num_processes"]


def _join_tensorflow():
    from keras_parallel.cluster_environments import tf_config

    if not tf_config.wanted():
        return None
    # Imported late: it imports TensorFlow and checks Keras's internals (an
    # `UnsupportedKerasError` is then this join's error).
    from keras_parallel.backends.tensorflow import workers

    _mark_joined()
    strategy = workers.initialize_from_environment()
    if strategy is None:
        return None
    return strategy.worker_index, strategy.num_workers


_JOINS = {"jax": _join_jax, "tensorflow": _join_tensorflow}


def _join_error(error):
    """`error` as a `ClusterJoinError` naming the join and the opt-out."""
    return ClusterJoinError(
        "keras_parallel's cluster join failed while Keras was imported: this "
        "process was started as one of several (srun, mpirun, torchrun, "
        "KERAS_DISTRIBUTION_* or TF_CONFIG) and could not join the others. "
        f"Received: {type(error).__name__}: {error} (cluster environment: "
        f"{cluster_environments.describe_environment()}); fix what it names, "
        f"or set {cluster_environments.OPT_OUT_VAR}=off to run each process "
        "alone, without reading any cluster variable."
    )


def install_excepthook(rank, world_size):
    """Makes an uncaught exception end this process at once, naming its rank.

    Prints the traceback, then exits with code 1 without `atexit`: JAX's
    `atexit` waits at a barrier for the others, which wait for this process in
    a collective (5 minutes, JAX's shutdown timeout). Once it exits, their
    collectives fail within seconds; one that had never run before, still
    connecting to this process, waits for JAX's heartbeat timeout (100 s).
    Installed once.
    """
    if getattr(sys.excepthook, "_keras_parallel_rank", None) is not None:
        return
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        try:
            print(
                f"keras_parallel: rank {rank} of {world_size} raised the "
                "error below; it exits now, without waiting for the other "
                "processes at the runtime's shutdown:",
                file=sys.stderr,
            )
            previous(kind, value, traceback)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # A closed stream must not keep it alive.
                    pass
            os._exit(1)

    excepthook._keras_parallel_rank = rank
    sys.excepthook = excepthook
