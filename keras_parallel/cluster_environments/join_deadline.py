"""A bound on the wait for a cluster job's other processes, and its error.

Past `KERAS_PARALLEL_JOIN_TIMEOUT` seconds, a process a mistake left waiting (a
rank nobody started, one given twice, rank 0's port taken) says what to check
and ends. A watchdog process keeps the deadline, not a thread: TensorFlow holds
Python's lock while it waits.
"""

import contextlib
import os
import subprocess
import sys
import warnings

from keras_parallel.cluster_environments import record_joined
from keras_parallel.cluster_environments.base import (
    HELD_PORT_VAR,
    ClusterEnvironmentError,
    bind_error,
    environment_error,
    positive_seconds,
)

JOIN_TIMEOUT_VAR = "KERAS_PARALLEL_JOIN_TIMEOUT"
#: Processes that srun, mpirun or `keras-parallel launch` start meet within
#: seconds; under 60 s, a mistake ends the job within a minute. Kubernetes pods
#: may start minutes apart: docs/multihost.md sets more there.
DEFAULT_JOIN_TIMEOUT_S = 45.0

#: What the joining process writes to its watchdog once the join is over.
_JOINED = b"joined"

# Kills process `argv[1]` after `argv[2]` seconds, printing `argv[3]`, unless
# its stdin (a pipe from that process) closes first. The process writes
# `_JOINED` before closing it; a pipe closed without it means the process died
# inside the runtime's join (JAX segfaults where its port is taken), and
# `argv[4]` says what to check. Ctrl-C is the process's, not the watchdog's.
_WATCHDOG = f"""
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, seconds = int(sys.argv[1]), float(sys.argv[2])
late, died = sys.argv[3], sys.argv[4]
closed, _, _ = select.select([sys.stdin], [], [], seconds)
if not closed:
    sys.stderr.write(late + "\\n")
    sys.stderr.flush()
    os.kill(parent, signal.SIGKILL)
elif sys.stdin.buffer.read() != {_JOINED!r}:
    sys.stderr.write(died + "\\n")
    sys.stderr.flush()
"""


def join_timeout_seconds(environ=None):
    """`KERAS_PARALLEL_JOIN_TIMEOUT` in seconds, or the default 45.

    Raises:
        ClusterEnvironmentError: the value is not a positive number.
    """
    environ = os.environ if environ is None else environ
    return positive_seconds(environ, JOIN_TIMEOUT_VAR, DEFAULT_JOIN_TIMEOUT_S, 300)


def check_port_free(env, address):
    """Fails at once where this process cannot bind `address`'s port.

    Call it in the process that binds it, before the runtime tries: the
    runtime's own failure names neither the port's variable nor the rank.
    `address` is `host:port`; the port is tried on every interface.

    Raises:
        ClusterEnvironmentError: the port is taken; the message names the
            variables that set it and the rank.
    """
    port = int(address.rsplit(":", 1)[1])
    # A port the launcher holds for this process (`launcher.ports`) is free
    # to its gRPC server, which binds as SO_REUSEPORT lets it.
    held = os.environ.get(HELD_PORT_VAR) == str(port)
    error = bind_error("", port, reuse_port=held)
    if error is not None:
        raise environment_error(
            f"{env.name}: rank {env.global_rank()} must listen on port "
            f"{port}, which is taken on this host ({error.strerror}): "
            "another program holds it, or another process of this job "
            f"was given the same {env.RANK_VAR}",
            env.describe(),
            f"free the port, or choose another (this one comes from "
            f"{env.port_source()}), or give each process its own "
            f"{env.RANK_VAR}",
        )


@contextlib.contextmanager
def port_checked(env, address):
    """Checks `address`'s port before the body binds it, and again if it fails.

    Two processes given the same rank can both find the port free; the later
    one's runtime then fails with its own error (torch: `EADDRINUSE`), which
    names neither variable. Where the body fails and the port is taken by
    then, the named error is raised from the runtime's.

    Raises:
        ClusterEnvironmentError: the port is taken, before the body or after
            it failed.
    """
    check_port_free(env, address)
    try:
        yield
    except Exception as error:
        try:
            check_port_free(env, address)
        except ClusterEnvironmentError as named:
            raise named from error
        raise


def join_failure_message(env, address, seconds):
    """What a process that did not meet the others in time prints."""
    size = env.world_size()
    return (
        f"keras_parallel: rank {env.global_rank()} of {size} did not meet the "
        f"other processes of its {env.name} job within {seconds:g} s "
        f"({JOIN_TIMEOUT_VAR}), so it ends. Received: {env.describe()}; check "
        f"that all {size} processes were started ({env.world_size_text()}), "
        f"{_each_rank_and_the_port(env, address)}. Where processes start more "
        f"than {seconds:g} s apart (Kubernetes pods pulling images), set "
        f"{JOIN_TIMEOUT_VAR} to more seconds."
    )


def join_crash_message(env, address):
    """What the watchdog prints where the process died inside the join."""
    return (
        f"keras_parallel: rank {env.global_rank()} of {env.world_size()} "
        f"ended while it joined the other processes of its {env.name} job: "
        "it was killed, or the runtime crashed (its last lines are above). "
        f"Received: {env.describe()}; check {_each_rank_and_the_port(env, address)}"
        ": two processes of one rank, or another program on rank 0's port, "
        "crash some runtimes (JAX) before they can say which."
    )


def _each_rank_and_the_port(env, address):
    return (
        f"that each process has its own {env.RANK_VAR} from 0 to "
        f"{env.world_size() - 1}, and that rank 0 could listen on {address} "
        f"(its port derived from {env.port_source()})"
    )


@contextlib.contextmanager
def join_deadline(env, address):
    """Ends this process, saying what to check, if the body outlasts the deadline.

    `address` is rank 0's `host:port`, where the runtime meets. Once the body
    has run, `env` is recorded as the environment joined by (`record_joined`).

    Raises:
        ClusterEnvironmentError: `KERAS_PARALLEL_JOIN_TIMEOUT` is wrong.
    """
    seconds = join_timeout_seconds(env.environ)
    watchdog = _start_watchdog(
        seconds,
        join_failure_message(env, address, seconds),
        join_crash_message(env, address),
    )
    try:
        yield
    finally:
        if watchdog is not None:
            try:
                watchdog.stdin.write(_JOINED)  # Its signal to end quietly.
                watchdog.stdin.close()
            except OSError:
                pass  # It ended already (killed with the process group).
            try:
                watchdog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                watchdog.kill()
                watchdog.wait()
    record_joined(env)


def _start_watchdog(seconds, late_message, crash_message):
    """The watchdog process, or None with a warning where no Python can run it
    (a frozen application's `sys.executable`, an embedded interpreter's)."""
    command = [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid())]
    try:
        if getattr(sys, "frozen", False) or not sys.executable:
            raise OSError(f"sys.executable={sys.executable!r} is not a Python")
        return subprocess.Popen(
            [*command, str(seconds), late_message, crash_message],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
    except OSError as error:
        warnings.warn(
            f"keras_parallel cannot bound the wait for the other processes "
            f"({JOIN_TIMEOUT_VAR}): no Python to run its watchdog. Received: "
            f"{error}; a mistake in the cluster's variables will end this "
            "process only at the runtime's own timeout.",
            stacklevel=3,
        )
        return None
