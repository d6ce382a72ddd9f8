"""Runs the JAX and TensorFlow processes of one node and ends them together.

Where torch has torchrun's agent: the first failure is named and the others
ended, a signal to the launcher goes to every process, and a failed group is
restarted up to `max_restarts` times.
"""

import signal
import subprocess
import sys
import time

from keras_parallel.persistence.preemption_settings import (
    PREEMPTED_EXIT_CODE,
    grace_seconds,
)
from keras_parallel.run.stall_settings import STALLED_EXIT_CODE

#: Seconds the others get to stop by themselves after one failed. A JAX process
#: waiting on a dead peer never does (seen: still waiting after 10 s).
FAILURE_GRACE_S = 5.0
#: Exit status of a process whose collective a peer broke: named as the
#: failure only if no other process names a cause within `FAILURE_GRACE_S`.
BROKEN_COLLECTIVE_EXIT_CODE = 76
#: Seconds between SIGTERM and SIGKILL. JAX's preemption notifier only records
#: SIGTERM, so a JAX process stuck in a collective ends at the SIGKILL.
TERMINATE_GRACE_S = 5.0


def supervise(commands, label="process", max_restarts=0):
    """Starts one process per `(argv, env)` and waits for all of them.

    Args:
        commands: a list of `(argv, env)`, one per process, in rank order;
            or a function of the attempt number (0, 1, ...) that returns
            one (a restart may need new ports).
        label: what the messages call a process.
        max_restarts: how many times a failed group is ended and started
            again, whole (as torchrun's `--max-restarts`); each attempt's
            processes see `KERAS_PARALLEL_RESTART_COUNT`. A launcher stopped
            by a signal does not restart.

    Returns:
        0, the first failed process's exit code (1 if a signal ended it),
        or 128 + the signal number if the launcher was stopped by one.
    """
    stopped = []

    def stop(signum, frame):
        stopped.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(max_restarts + 1):
            group = commands(attempt) if callable(commands) else commands
            code = _run_group(group, attempt, stopped, label)
            if code in (0, PREEMPTED_EXIT_CODE) or stopped or attempt == max_restarts:
                # A preempted group is not restarted: its machines are
                # going away; the same command resumes it later.
                return code
            print(
                f"keras-parallel launch: starting every {label} again (restart "
                f"{attempt + 1} of {max_restarts}).",
                file=sys.stderr,
            )
        return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


#: The attempt number each process sees: 0, then 1 after the first restart.
RESTART_ENV = "KERAS_PARALLEL_RESTART_COUNT"


def _run_group(commands, attempt, stopped, label):
    processes = []
    try:
        for argv, env in commands:
            processes.append(subprocess.Popen(argv, env=_process_env(env, attempt)))
        return _wait(processes, stopped, label)
    finally:
        _end(processes)


def _process_env(env, attempt):
    """`env` for attempt `attempt`, without `KERAS_PARALLEL_JOINED_PID`: the
    processes must join each other, not run alone as a joined process's
    children (`cluster_join.may_join`)."""
    from keras_parallel.cluster_environments.join import JOINED_PID_VAR
    from keras_parallel.launcher import parent_death

    env = {k: v for k, v in env.items() if k != JOINED_PID_VAR}
    env[RESTART_ENV] = str(attempt)
    return parent_death.mark_launcher(env)


def _wait(processes, stopped, label):
    failed_at = None
    failure = None
    broken = None  # (rank, when): a process whose collective broke.
    preempted_at = None
    forwarded = False
    while True:
        codes = [p.poll() for p in processes]
        if stopped and not forwarded:
            # Passed on at once, so each process has the preemption grace to
            # stop at an agreed step and back up (SIGTERM is a preemption).
            forwarded = True
            preempted_at = time.monotonic()
            print(
                f"keras-parallel launch: stopped by signal {stopped[0]}; "
                f"passing it to every {label}.",
                file=sys.stderr,
            )
            for process, code in zip(processes, codes, strict=True):
                if code is None:
                    process.send_signal(stopped[0])
        if failure is None:
            for rank, code in enumerate(codes):
                if code == PREEMPTED_EXIT_CODE and preempted_at is None:
                    preempted_at = time.monotonic()
                elif code == BROKEN_COLLECTIVE_EXIT_CODE and broken is None:
                    broken = (rank, time.monotonic())
                elif code not in (
                    None,
                    0,
                    PREEMPTED_EXIT_CODE,
                    BROKEN_COLLECTIVE_EXIT_CODE,
                ):
                    failure = (rank, code)
                    break
            if failure is None and broken is not None:
                # No process named a cause in time: the broken one it is.
                ended = all(code is not None for code in codes)
                if ended or time.monotonic() - broken[1] > FAILURE_GRACE_S:
                    failure = (broken[0], 1)
            if failure is not None:
                failed_at = time.monotonic()
                rank, code = failure
                how = how_it_ended(codes[rank])
                if codes[rank] == BROKEN_COLLECTIVE_EXIT_CODE:
                    how = "failed in a collective a peer broke (its traceback is above)"
                print(
                    f"keras-parallel launch: {label} {rank} {how}; ending the others.",
                    file=sys.stderr,
                )
        if all(code is not None for code in codes):
            break
        if failure is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            break
        if preempted_at is not None and time.monotonic() - preempted_at > (
            preemption_wait_s()
        ):
            break
        time.sleep(0.1)
    if failure is None and codes and all(c == PREEMPTED_EXIT_CODE for c in codes):
        print(
            f"keras-parallel launch: preempted: every {label} stopped at the "
            "same step (exit code 75); run the same command to resume from "
            "its backup.",
            file=sys.stderr,
        )
        return PREEMPTED_EXIT_CODE
    if stopped:
        return 128 + stopped[0]
    if failure is None:
        if preempted_at is not None:
            print(
                f"keras-parallel launch: a {label} was preempted and the "
                "others did not stop in time; ending them.",
                file=sys.stderr,
            )
            return PREEMPTED_EXIT_CODE
        return 0
    code = failure[1]
    return code if code > 0 else 1


def preemption_wait_s():
    """Seconds the processes get to stop after a preemption: its grace + 10."""
    try:
        return grace_seconds() + 10.0
    except ValueError:
        return 30.0


def how_it_ended(code, raised=False):
    """How a failed process ended, for the launcher's message: what follows
    its name, e.g. `"was killed by signal 9 (SIGKILL)"`. `code` is its exit
    status (negative: the signal that killed it); `raised`, whether it printed
    a traceback before a signal killed it (torchrun: the rank recorded its
    exception, then was ended).
    """
    if code == STALLED_EXIT_CODE:
        return (
            f"stalled, or waited for one that did (exit code {code}; the "
            "report is above)"
        )
    if code >= 0:
        return f"failed with exit code {code} (its traceback is above)"
    try:
        name = f" ({signal.Signals(-code).name})"
    except ValueError:
        name = ""
    if raised:
        return (
            f"failed (its traceback is above), then was killed by signal {-code}{name}"
        )
    # Killed from outside (often the kernel's out-of-memory killer): it
    # printed nothing, so point to no traceback.
    return f"was killed by signal {-code}{name}"


def _end(processes):
    """SIGTERM, then SIGKILL, whatever still runs; waits for every one."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
