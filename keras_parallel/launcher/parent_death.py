"""A launched process ends when its launcher ends, however the launcher ends.

A launcher killed without a chance to end its processes (SIGKILL: the OOM
killer, `kill -9`, a scheduler's last resort) would leave them training,
holding their devices and ports. On Linux, every process keras_parallel's
launchers start asks the kernel, first thing, for SIGKILL when the process
that started it ends (`prctl(PR_SET_PDEATHSIG)`), and ends at once if that
process is already gone. Its last backup stays: the same command resumes.
Elsewhere (macOS, Windows) nothing is asked: the launcher's own handlers
still end its processes when it is stopped by SIGINT or SIGTERM.
"""

import ctypes
import os
import signal
import sys

#: The launcher's process id, in the environment of each process it starts.
LAUNCHER_PID_ENV = "KERAS_PARALLEL_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def mark_launcher(env):
    """`env`, the environment a launched process gets (changed in place),
    naming this process as its launcher."""
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    return env


def end_with_launcher(environ=None):
    """Asks for SIGKILL when the launcher that started this process ends;
    returns whether the kernel will end this process with its launcher.

    The launcher is the process named by `KERAS_PARALLEL_LAUNCHER_PID` in
    `environ` (default `os.environ`); a process started otherwise (no such
    variable) is left alone. If this process's parent is no longer that
    launcher (it ended before the request could be made), it ends at once.
    """
    environ = os.environ if environ is None else environ
    launcher = environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit() or not _ask_for_sigkill():
        return False
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def end_with_parent():
    """Asks for SIGKILL when this process's parent (any parent) ends;
    returns whether the kernel will end this process with its parent.

    For processes started by `multiprocessing` (`keras_parallel.launch`),
    whose parent is the launching process or its fork server; a process
    already orphaned (adopted by init) ends at once.
    """
    if not _ask_for_sigkill():
        return False
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _ask_for_sigkill():
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
