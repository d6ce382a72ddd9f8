"""The torch process group: started from the environment, torn down once.

A group started here is destroyed here at exit; one the user started is the
user's. A failing rank leaves its error under `FAILURE_KEY` in the group's
store (the launcher's under torchrun and `launch`: it outlives every rank), so
the others raise `PeerFailedError` naming it.
"""

import atexit
import contextlib
import datetime
import os
import weakref

import torch
import torch.distributed as dist

from keras_parallel import cluster_environments
from keras_parallel.cluster_environments import join_deadline
from keras_parallel.cluster_environments.base import host_port
from keras_parallel.messages import run_secret, signed_store

#: Where a failing rank leaves its name and error in the group's store.
FAILURE_KEY = "keras_parallel/failed"
#: Seconds a collective waits for a peer (one that died silently) before failing.
DEFAULT_TIMEOUT_S = 300
TIMEOUT_ENV = "KERAS_PARALLEL_TIMEOUT"
#: `"1"`: a group of one process runs the distributed path (docs/torch.md).
ONE_PROCESS_GROUP_ENV = "KERAS_PARALLEL_ONE_PROCESS_GROUP"

_started_here = False
_teardown_hooks = weakref.WeakSet()


class PeerFailedError(RuntimeError):
    """Another rank of the process group failed, so this one stops.

    Attributes:
        rank: the rank that failed, or `None` if it could not be told.
    """

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


def timeout_seconds():
    """The collective timeout: `$KERAS_PARALLEL_TIMEOUT`, else 300 s."""
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"{TIMEOUT_ENV} must be a number of seconds. Received: "
            f"{TIMEOUT_ENV}={value!r}; set it to e.g. 60."
        ) from None
    if seconds <= 0:
        raise ValueError(
            f"{TIMEOUT_ENV} must be positive. Received: {TIMEOUT_ENV}={value!r}."
        )
    return seconds


def env_world_size():
    """`WORLD_SIZE` as set by `torchrun` / `launch`, or 1."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def one_process_group():
    """Whether a group of one process runs the distributed path."""
    return os.environ.get(ONE_PROCESS_GROUP_ENV) == "1"


def is_distributed():
    """Whether a group of several processes (or one, with `one_process_group()`)
    is running."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size() > 1 or one_process_group()


def ensure_process_group():
    """Starts the process group the environment asks for, once.

    Returns:
        True if a group of more than one process is running now.
    """
    global _started_here
    env = None
    if not (dist.is_available() and dist.is_initialized()):
        # Detected before torch's variables are filled, so that its messages
        # name the launcher's (`SLURM_PROCID`, not `RANK`).
        env = cluster_environments.detect_cluster_environment(dict(os.environ))
        fill_from_cluster_environment()
    if not dist.is_available():
        if env_world_size() > 1:
            raise RuntimeError(
                "WORLD_SIZE asks for several processes but this torch build "
                "has no torch.distributed. Received: WORLD_SIZE="
                f"{env_world_size()}; install a torch build with distributed "
                "support."
            )
        return False
    if dist.is_initialized():
        return is_distributed()
    alone = env_world_size() <= 1 and not one_process_group()
    if alone or "MASTER_ADDR" not in os.environ:
        return False
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        # Before any variable exists: Keras uses the current CUDA device.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_seconds())
    backend = "nccl" if use_cuda else "gloo"
    with _bounded_join(env):
        store = _store_of_this_attempt(timeout)
        if store is None and env is not None and env.world_size() > 1:
            store = _store_bound_to_main_address(timeout)
        joined = {"init_method": "env://"}
        if store is not None:
            rank = int(os.environ["RANK"])
            joined = {"store": store, "rank": rank, "world_size": env_world_size()}
        dist.init_process_group(backend=backend, timeout=timeout, **joined)
    _started_here = True
    atexit.register(teardown)
    return is_distributed()


@contextlib.contextmanager
def _bounded_join(env):
    """Checks rank 0's port, then bounds the wait for the other ranks.

    A missing or doubled rank, or a taken port, ends every rank within
    `KERAS_PARALLEL_JOIN_TIMEOUT` (torch would wait the collective timeout).
    Under torchrun the elastic agent holds the port: nothing is checked.
    """
    if env is None or env.world_size() <= 1:
        yield  # Variables torch reads itself, not a launcher's.
        return
    address = host_port(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    with contextlib.ExitStack() as checks:
        if env.global_rank() == 0 and not agent_store:
            checks.enter_context(join_deadline.port_checked(env, address))
        checks.enter_context(join_deadline.join_deadline(env, address))
        yield


def fill_from_cluster_environment(environ=None):
    """Sets torch's `RANK`, `WORLD_SIZE`, ... from the cluster environment
    (`srun`, `mpirun`) where they are unset.

    Args:
        environ: the variables to read and fill; `os.environ` when None.

    Returns:
        The names it set.
    """
    environ = os.environ if environ is None else environ
    env = cluster_environments.detect_cluster_environment(environ)
    if env is None or env.world_size() <= 1:
        return []
    wanted = cluster_environments.environment_variables(env, "torch")
    filled = [name for name in wanted if not environ.get(name)]
    for name in filled:
        environ[name] = wanted[name]
    return filled


def _store_of_this_attempt(timeout):
    """The elastic agent's store under a prefix of this restart attempt.

    Every attempt shares the agent's TCPStore and `env://` does not tell them
    apart: a restarted rank could read the previous attempt's address and fail
    ("Gloo connectFullMesh failed ... Connection refused", 2 runs in 5).

    Returns:
        A `PrefixStore`, or None where `env://` is safe (no agent store).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=env_world_size(),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"/keras_parallel/attempt_{attempt}", store)


def _store_bound_to_main_address(timeout):
    """The run's `TCPStore`, rank 0's listening on `MASTER_ADDR` alone.

    torch's `env://` store of rank 0 binds every interface (`[::]`),
    whatever `MASTER_ADDR` says: under srun or mpirun on one host that is
    the network too. Here rank 0 binds the one address the other ranks
    reach it at, and hands the socket to the store (`master_listen_fd`), as
    `keras_parallel.launch` does.
    """
    import socket

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world_size, rank = env_world_size(), int(os.environ["RANK"])
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family, kind, protocol, _, where = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    )[0]
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def device_type():
    """`"cuda"` when each rank drives a GPU, else `"cpu"`."""
    if dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def on_teardown(hook):
    """Registers `hook` (held weakly) whose `close()` runs before the group goes.

    A DDP wrapper that outlives `destroy_process_group` can hang a rank at exit.
    """
    _teardown_hooks.add(hook)


def teardown():
    """Closes the registered DDP wrappers, then the group if we started it."""
    global _started_here
    for hook in list(_teardown_hooks):
        try:
            hook.close()
        except Exception:  # Teardown must go on: each hook is best effort.
            pass
    _teardown_hooks.clear()
    if _started_here and dist.is_available() and dist.is_initialized():
        _started_here = False
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # Private API: without it failures are just unnamed.
        return None


class KeyValueStore:
    """The process group's store (torchrun's or the rendezvous TCPStore).

    Raises:
        RuntimeError: the process group has no store this torch exposes.
    """

    def __init__(self):
        self._store = _store()
        if self._store is None:
            raise RuntimeError(
                "torch's process group has no key-value store to agree on a "
                "preemption stop. Received: torch "
                f"{torch.__version__}; set KERAS_PARALLEL_PREEMPTION_SIGNALS="
                "none to train without the preemption watch."
            )

    def set(self, key, value):
        self._store.set(key, value)

    def try_get(self, key):
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode()


def publish_failure(rank, error):
    """Leaves `"<rank>: <error>"` in the store; the first failure wins."""
    if isinstance(error, PeerFailedError):
        return
    store = _store()
    if store is None:
        return
    try:
        text = f"{type(error).__name__}: {error}"[:2000]
        store.compare_set(
            FAILURE_KEY,
            "",
            signed_store.signed_text(_secret(), FAILURE_KEY, rank, text),
        )
    except Exception:
        pass


def _secret():
    return run_secret.run_secret() or b""


def peer_failure(wait_s=5.0):
    """The failure another rank published, as `(rank, text)`, or `None`.

    Args:
        wait_s: how long to wait: the failing rank may write it after our
            collective broke.
    """
    store = _store()
    if store is None:
        return None
    try:
        store.wait([FAILURE_KEY], datetime.timedelta(seconds=wait_s))
        stored = store.get(FAILURE_KEY)
    except Exception:
        return None
    try:
        return signed_store.checked_text(_secret(), FAILURE_KEY, stored)
    except signed_store.UntrustedValueError:
        return None  # Not the run's: no rank named, nothing of it shown.


def peer_failed_error(error, own_rank, where):
    """The `PeerFailedError` to raise when a collective broke, naming the
    failed rank where known.

    Args:
        error: what the collective raised.
        where: what this rank was doing (`"train step 3"`).
    """
    found = peer_failure()
    if found is not None and found[0] != own_rank:
        rank, message = found
        return PeerFailedError(
            f"Rank {rank} failed, so rank {own_rank} stopped during {where}. "
            f"Rank {rank} raised: {message}. See rank {rank}'s traceback for "
            "the cause.",
            rank=rank,
        )
    return PeerFailedError(
        f"A collective failed on rank {own_rank} during {where}, most likely "
        f"because another rank stopped. Received: {type(error).__name__}: "
        f"{error}. See the other ranks' output for the cause; "
        f"{TIMEOUT_ENV} bounds how long a rank waits for a silent peer."
    )


def is_collective_failure(error):
    """Whether `error` is a broken collective: `DistError` or a gloo/NCCL
    connection error."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        word in text
        for word in (
            "gloo",
            "nccl",
            "connection closed",
            "connection reset",
            "timed out",
        )
    )
