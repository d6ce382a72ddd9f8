"""The stall watch's settings, read without importing Keras (the launcher
reads them too): `run/stall_watch.py` is the watch.
"""

import os

#: The stall timeout, in seconds, in the processes' environment (set by
#: `keras-parallel launch --stall-timeout`); 0 turns the watch off.
STALL_TIMEOUT_VARIABLE = "KERAS_PARALLEL_STALL_TIMEOUT"
#: 240 s: a synchronous run's processes are never a step apart for long,
#: whatever a step costs (a slow step is slow on every process, a first
#: compile runs on every process, a save that is a collective is one
#: position for all), so a healthy run never fires it; and it names the
#: stalled process before torch's collectives give up on it (300 s,
#: `KERAS_PARALLEL_TIMEOUT`).
DEFAULT_STALL_TIMEOUT_S = 240.0
#: The exit code of every process of a stalled run (75 is a preemption's,
#: 76 a collective another process broke: `launcher/supervisor.py`).
STALLED_EXIT_CODE = 77


def stall_timeout(environ=None):
    """The stall timeout in seconds (`KERAS_PARALLEL_STALL_TIMEOUT`); None
    when turned off (0).

    Raises:
        ValueError: the variable is not a number of seconds >= 0.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(STALL_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_STALL_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(
            f"{STALL_TIMEOUT_VARIABLE} must be a number of seconds, 0 to turn "
            f"the stall watch off. Received: {text!r}; set it to, say, "
            f"{DEFAULT_STALL_TIMEOUT_S:g}."
        )
    return seconds or None


#: Set by `keras-parallel launch` in every process it starts (its pid:
#: `launcher/parent_death.py`, a layer above this one): under it, the
#: stalled process's report is the only one.
LAUNCHED_VARIABLE = "KERAS_PARALLEL_LAUNCHER_PID"


def take_stall_timeout_option(argv):
    """`keras-parallel launch`'s arguments `argv` without `--stall-timeout
    S`, which is set in this process's environment for every process it
    starts (`KERAS_PARALLEL_STALL_TIMEOUT`).

    Raises:
        ValueError: S is not a number of seconds >= 0.
    """
    rest = list(argv)
    for i, arg in enumerate(rest):
        if arg.endswith(".py"):
            break  # The script: what follows is its own.
        if arg == "--stall-timeout" or arg.startswith("--stall-timeout="):
            if "=" in arg:
                value, taken = arg.split("=", 1)[1], 1
            elif i + 1 < len(rest):
                value, taken = rest[i + 1], 2
            else:
                raise ValueError(
                    "--stall-timeout needs a number of seconds. Received: no "
                    "value; pass e.g. --stall-timeout 240 (0 turns it off)."
                )
            try:
                stall_timeout({STALL_TIMEOUT_VARIABLE: value})
            except ValueError:
                raise ValueError(
                    "--stall-timeout must be a number of seconds, 0 to turn the "
                    f"stall watch off. Received: --stall-timeout {value!r}; pass "
                    "e.g. --stall-timeout 240."
                ) from None
            os.environ[STALL_TIMEOUT_VARIABLE] = value
            del rest[i : i + taken]
            break
    return rest
