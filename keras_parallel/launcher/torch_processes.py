"""`launch(fn, num_processes)`: a function in N processes, from Python or a notebook.

Each process gets the environment torchrun gives, from which keras_parallel
starts the process group (docs/torch.md).
"""

import os
import pickle
import sys
import time
import traceback

from keras_parallel.launcher.ports import gloo_on_loopback, loopback_listener
from keras_parallel.messages import run_secret

#: Seconds the other ranks get to stop by themselves after one failed.
FAILURE_GRACE_S = 30.0


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process, as text."""

    def __init__(self, text):
        super().__init__(text)
        self.text = text

    def __str__(self):
        return "\n" + self.text


class ProcessFailedError(RuntimeError):
    """A launched process failed with an error that could not be re-raised.

    Attributes:
        rank: the failed rank.
    """

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


def launch(
    fn,
    num_processes,
    args=(),
    *,
    timeout=None,
    collective_timeout=None,
    threads_per_process=None,
    start_method="spawn",
):
    """Runs `fn(*args)` in `num_processes` processes, one per device.

    Each process gets the `torchrun` environment (`RANK`, `WORLD_SIZE`,
    `LOCAL_RANK`, `MASTER_ADDR=127.0.0.1`, a free `MASTER_PORT`), so
    `keras_parallel.DataParallel()` inside `fn` spans all of them and the
    unchanged `model.fit` runs under `DistributedDataParallel` (gloo on CPU,
    NCCL with GPUs).

    Args:
        fn: a function importable by name (defined in a module, not in
            `__main__` of a notebook: processes are started with `spawn`).
        num_processes: how many processes (ranks) to start.
        args: the positional arguments of `fn`, picklable.
        timeout: seconds the whole run may take; `None` for no limit. Past
            it, every process is ended and `TimeoutError` is raised.
        collective_timeout: seconds a collective waits for a silent peer
            (`KERAS_PARALLEL_TIMEOUT`, default 300).
        threads_per_process: torch threads in each process; defaults to the
            CPU count divided by `num_processes` (at least 1), unless
            `OMP_NUM_THREADS` is set.
        start_method: the `multiprocessing` start method.

    Returns:
        The values `fn` returned, ordered by rank.

    Raises:
        Exception: the exception of the first rank that failed, re-raised
            with its traceback (as `__cause__`), a `rank` attribute and
            `rank_errors` (`{rank: "Type: message"}` of every failed rank);
            other ranks are ended. `ProcessFailedError` if it cannot be re-raised
            as itself (unpicklable, or the process died without a word).
        TimeoutError: `timeout` passed.

    Example:

    ```python
    def train(epochs):
        model = make_model()  # a keras_parallel.DistributedModel
        model.compile(..., distribution=keras_parallel.DataParallel())
        model.fit(x, y, batch_size=64, epochs=epochs)
        return model.evaluate(x_test, y_test)

    if __name__ == "__main__":  # each process imports this script again
        results = keras_parallel.launch(train, num_processes=2, args=(3,))
    ```
    """
    import multiprocessing

    from torch.distributed import TCPStore

    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(
            "num_processes must be a positive int. Received: "
            f"num_processes={num_processes!r}; pass e.g. 2."
        )
    if threads_per_process is None:
        threads_per_process = max(1, (os.cpu_count() or 1) // num_processes)
    # The store the ranks rendezvous on lives here, as torchrun's agent
    # store does: it outlives every rank, so failures can still be named.
    # On a socket of ours, bound to loopback: nothing off this machine can
    # reach the store or join the group.
    listener = loopback_listener()
    port = listener.getsockname()[1]
    # The store owns the socket from here, and closes it when it goes.
    store = TCPStore(
        "127.0.0.1",
        port,
        num_processes,
        True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    context = multiprocessing.get_context(start_method)
    results = context.SimpleQueue()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        **gloo_on_loopback(),
        # The run's secret (`signed_store`): made here unless given.
        **run_secret.for_children(),
    }
    if collective_timeout is not None:
        env["KERAS_PARALLEL_TIMEOUT"] = str(collective_timeout)
    processes = []
    for rank in range(num_processes):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        process = context.Process(
            target=_child,
            args=(fn, tuple(args), rank, rank_env, threads_per_process, results),
            name=f"keras-parallel-rank-{rank}",
        )
        process.start()
        processes.append(process)
    try:
        return _collect(processes, results, timeout)
    finally:
        _end(processes)
        del store


def _child(fn, args, rank, env, threads, results):
    """The body of one launched process: run `fn`, report, exit."""
    from keras_parallel.launcher import parent_death

    # A launching process killed outright must not leave its ranks running.
    parent_death.end_with_parent()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    code = 0
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        value = fn(*args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as error:  # Reported to the parent, whatever it is.
        code = 1
        results.put((rank, "error", _describe(error)))
    finally:
        _teardown_child()
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip the interpreter's own teardown: everything that must close was
    # closed above, and a half-torn-down process group can hang a rank.
    os._exit(code)


def _describe(error):
    from keras_parallel.backends.torch import group

    rank = int(os.environ.get("RANK", "0"))
    secondary = isinstance(error, group.PeerFailedError)
    try:
        if not secondary and group.is_collective_failure(error):
            # A collective broken by a rank that failed first (outside a
            # step: a callback, a check): that rank's error is the cause.
            found = group.peer_failure()
            secondary = found is not None and found[0] != rank
        if not secondary:
            group.publish_failure(rank, error)
    except Exception:
        pass
    try:
        payload = pickle.dumps(error)
        pickle.loads(payload)
    except Exception:
        payload = None
    return {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(
            traceback.format_exception(type(error), error, error.__traceback__)
        ),
        "pickled": payload,
        "secondary": secondary,
    }


def _teardown_child():
    try:
        from keras_parallel.backends.torch import group as torch_group

        torch_group.teardown()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _collect(processes, results, timeout):
    n = len(processes)
    values = [None] * n
    done = set()
    failures = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at = None
    while len(done) < n:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            missing = sorted(set(range(n)) - done)
            raise TimeoutError(
                f"launch: ranks {missing} did not finish within "
                f"timeout={timeout} s. Received: num_processes={n}; raise "
                "`timeout`, or look for a rank waiting on the others."
            )
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            break
        message = _poll(results)
        if message is None:
            for rank, process in enumerate(processes):
                if rank not in done and not process.is_alive():
                    time.sleep(0.2)  # Its report may still be in the pipe.
                    message = _poll(results)
                    if message is None:
                        failure = {
                            "type": "ProcessFailedError",
                            "message": f"rank {rank} exited with code "
                            f"{process.exitcode} without reporting a result",
                            "traceback": "",
                            "pickled": None,
                            "secondary": False,
                        }
                        message = (rank, "error", failure)
                    break
            if message is None:
                continue
        rank, status, payload = message
        done.add(rank)
        if status == "ok":
            values[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            failed_at = failed_at or time.monotonic()
    if failures:
        _raise_first(failures, n)
    return values


def _poll(results, wait_s=0.05):
    # SimpleQueue has no timeout: poll its reader.
    if results._reader.poll(wait_s):
        return results.get()
    return None


def _raise_first(failures, n):
    primary = [r for r, f in failures.items() if not f["secondary"]]
    rank = min(primary) if primary else min(failures)
    failure = failures[rank]
    error = None
    if failure["pickled"] is not None:
        try:
            error = pickle.loads(failure["pickled"])
        except Exception:
            error = None
    if error is None:
        error = ProcessFailedError(
            f"Rank {rank} of {n} failed: {failure['type']}: {failure['message']}",
            rank=rank,
        )
    try:
        error.rank = rank
        # Every failed rank's error, as text: the others usually name `rank`.
        error.rank_errors = {
            r: f"{f['type']}: {f['message']}" for r, f in sorted(failures.items())
        }
    except Exception:
        pass
    if hasattr(error, "add_note"):
        error.add_note(f"(raised on rank {rank} of {n} processes started by launch)")
    raise error from RemoteTraceback(failure["traceback"] or failure["message"])


def _end(processes):
    for process in processes:
        process.join(timeout=5 if process.is_alive() else 0)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
