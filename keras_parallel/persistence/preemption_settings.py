"""The settings of preemption, read without importing Keras.

`persistence/preemption.py` acts on them inside an entry point; the
launcher (`launcher/supervisor.py`), which imports no Keras, reads the
same exit code and grace.
"""

import os
import signal

from keras_parallel.cluster_environments.base import positive_seconds

#: The exit code of a preempted run (sysexits.h's EX_TEMPFAIL): the job
#: was stopped on request and resumes when started again.
PREEMPTED_EXIT_CODE = 75

#: The environment variable naming the signals that preempt (comma-separated
#: names); SIGTERM and SIGUSR1 unless set. `none` turns the watch off.
SIGNALS_VARIABLE = "KERAS_PARALLEL_PREEMPTION_SIGNALS"
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
#: The environment variable giving the seconds a process may take, after
#: the signal, to reach the end of a batch (default `DEFAULT_GRACE_S`).
GRACE_VARIABLE = "KERAS_PARALLEL_PREEMPTION_GRACE"
#: Under the 30 s SLURM (`KillWait`) and Kubernetes
#: (`terminationGracePeriodSeconds`) leave between SIGTERM and SIGKILL.
DEFAULT_GRACE_S = 20.0


def preemption_signals(environ=None):
    """The signals that preempt, from `KERAS_PARALLEL_PREEMPTION_SIGNALS`.

    Args:
        environ: the environment to read; `os.environ` if None.

    Returns:
        A tuple of `signal.Signals` (empty when the variable says `none`).

    Raises:
        ValueError: the variable names a signal this system does not have.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(SIGNALS_VARIABLE, ",".join(DEFAULT_SIGNALS)).strip()
    if text.lower() in ("none", "off", ""):
        return ()
    found = []
    for name in (part.strip().upper() for part in text.split(",")):
        name = name if name.startswith("SIG") else f"SIG{name}"
        number = getattr(signal, name, None)
        if not isinstance(number, signal.Signals):
            raise ValueError(
                f"{SIGNALS_VARIABLE} names a signal this system does not have. "
                f"Received: {text!r}; name signals such as SIGTERM,SIGUSR1, "
                "or `none` to turn the preemption watch off."
            )
        found.append(number)
    return tuple(found)


def grace_seconds(environ=None):
    """The seconds from `KERAS_PARALLEL_PREEMPTION_GRACE` (default 20).

    Raises:
        ValueError: the variable is not a positive number.
    """
    environ = os.environ if environ is None else environ
    return positive_seconds(environ, GRACE_VARIABLE, DEFAULT_GRACE_S, 20)
