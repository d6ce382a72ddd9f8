"""Running a command with its processes, as the multi-process tests do.

`run_in_session` runs a command (a launcher and the processes it starts) in
a session of its own, so that on a timeout all of them are killed together;
`running` finds what a test left behind.
"""

import os
import signal
import subprocess
import time


def checkout_env(scikit_learn=False, tensorflow=None, **variables):
    """`os.environ` plus `variables`, importing this checkout's keras_parallel.

    The keras_parallel the tests imported comes first on `PYTHONPATH`, also
    when the tests run from a checkout rather than an installed package.

    Args:
        scikit_learn: whether the processes may import scikit-learn. Keras
            imports it at start when installed (its wrappers), about 30 % of
            a JAX process's import; only the demo's digits need it, so
            without it a `sklearn` that refuses to import comes first on the
            path (tests/without_scikit_learn), and Keras does without, as
            where scikit-learn is not installed.
        tensorflow: whether the processes may import TensorFlow. By default
            only where their backend (`KERAS_BACKEND` of `variables`, else
            of this process) is TensorFlow: `keras.utils.set_random_seed`
            imports it whenever installed, more than half of a JAX
            process's start (tests/without_tensorflow). `True` for a JAX or
            torch process that feeds a `tf.data` pipeline.
        **variables: environment variables to set.
    """
    import keras_parallel

    root = os.path.dirname(os.path.dirname(keras_parallel.__file__))
    here = os.path.dirname(os.path.abspath(__file__))
    folders = [root, here]
    if tensorflow is None:
        backend = variables.get("KERAS_BACKEND", os.environ.get("KERAS_BACKEND"))
        tensorflow = backend == "tensorflow"
    if not tensorflow:
        folders.insert(0, os.path.join(here, "without_tensorflow"))
    if not scikit_learn:
        folders.insert(0, os.path.join(here, "without_scikit_learn"))
    path = os.pathsep.join([*folders, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **variables)


def jax_launch_command(script, *args, options=()):
    """`keras-parallel launch` of `script` on 2 JAX processes x 4 devices."""
    import sys

    launch = [sys.executable, "-m", "keras_parallel.cli", "launch"]
    launch += ["--backend", "jax", "--nproc-per-node", "2"]
    launch += ["--devices-per-process", "4", *options]
    here = os.path.dirname(os.path.abspath(__file__))
    return launch + [os.path.join(here, script), *map(str, args)]


def run_in_session(command, env, timeout, cwd=None):
    """Runs `command` (in `cwd`) to its end; on `timeout`, kills its whole session.

    Returns:
        A `subprocess.CompletedProcess` with text stdout and stderr.

    Raises:
        subprocess.TimeoutExpired: after killing every process it started.
    """
    process = start_in_session(command, env, cwd)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def start_in_session(command, env, cwd=None):
    """`command` started in a session of its own, its output piped as text."""
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=cwd,
    )


def running(marker):
    """PIDs whose command line mentions `marker` (a per-test path)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def gone(marker, timeout=15):
    """Waits for every process whose command line mentions `marker` to end.

    A process killed with SIGKILL ends when the kernel is done with it,
    which on a busy machine takes a moment while its command line still
    reads (seen once in 20 soak runs, beside a large `pip install`).
    Returns the PIDs still running after `timeout` seconds (none, if all
    ended).
    """
    deadline = time.monotonic() + timeout
    while (left := running(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
