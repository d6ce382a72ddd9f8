"""Killed with SIGKILL mid-epoch and started again: the same final weights.

`tests/resume_script.py` trains with `keras.callbacks.BackupAndRestore`, a
shuffled uneven epoch and seeded dropout; it is killed in the middle of
epoch 2 (every process, with SIGKILL), the same command is run again, and
its final weights must equal an uninterrupted run. Keras's own
`BackupAndRestore` resumes with another shuffle (a 6e-2 difference here):
keras_parallel keeps the random state in the backup (`keras_parallel.backup`).
One JAX process with 8 devices, 2 JAX processes x 4 devices, 2 torch
processes. Every launch has a hard timeout; no process may be left.
"""

import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from subprocesses import checkout_env, run_in_session, running

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")
TIMEOUT_S = 240
BACKEND = keras.backend.backend()

pytestmark = pytest.mark.skipif(
    BACKEND not in ("jax", "torch"), reason="exact resume: JAX and torch"
)


def command(processes, *args):
    if processes == 1:
        return [sys.executable, SCRIPT, *map(str, args)]
    options = ["--nproc-per-node", str(processes)]
    if BACKEND == "jax":
        options += ["--devices-per-process", "4"]
    return [
        sys.executable,
        "-m",
        "keras_parallel.cli",
        "launch",
        "--backend",
        BACKEND,
        *options,
        SCRIPT,
        *map(str, args),
    ]


def run(processes, *args):
    result = run_in_session(
        command(processes, *args), checkout_env(KERAS_BACKEND=BACKEND), TIMEOUT_S
    )
    return result


def kill_every_process_at_killpoint(processes, out, backup):
    """Starts the run, waits for process 0 at the kill point, SIGKILLs all."""
    process = subprocess.Popen(
        command(processes, out, backup, "wait"),
        env=checkout_env(KERAS_BACKEND=BACKEND),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not os.path.exists(os.path.join(out, "killpoint")):
            assert process.poll() is None, process.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "never reached the kill point"
            time.sleep(0.2)
        for pid in running(str(out)):
            os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stderr.close()
    assert running(str(out)) == []


def final_weights(out):
    with np.load(os.path.join(out, "weights.npz")) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k[4:]))]


def reference_in_process():
    import resume_script

    model = resume_script.build()
    resume_script.train(model)
    return [np.asarray(w) for w in model.get_weights()]


def assert_weights_equal(actual, expected, rtol):
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.max(np.abs(b)))


@pytest.mark.skipif(BACKEND != "jax", reason="one JAX process, 8 devices")
def test_one_jax_process_killed_resumes_exactly(tmp_path):
    backup = tmp_path / "backup"
    killed = run(1, tmp_path, backup, "self")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(os.listdir(backup)) == [
        "training_metadata.json",
        "weights-2.weights.h5",
    ]
    resumed = run(1, tmp_path, backup)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert not backup.exists()  # Deleted at the end, as Keras does.
    expected = reference_in_process()
    for a, b in zip(final_weights(tmp_path), expected):
        np.testing.assert_array_equal(a, b)


def test_every_process_killed_resumes_exactly(tmp_path):
    backup = tmp_path / "backup"
    if BACKEND == "jax":
        expected = reference_in_process()  # 2 x 4 devices = 1 x 8 devices.
        rtol = 1e-5
    else:
        reference = tmp_path / "reference"
        reference.mkdir()
        result = run(2, reference, tmp_path / "reference_backup")
        assert result.returncode == 0, result.stderr[-4000:]
        expected = final_weights(reference)
        rtol = 1e-6
    kill_every_process_at_killpoint(2, tmp_path, backup)
    resumed = run(2, tmp_path, backup)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_weights_equal(final_weights(tmp_path), expected, rtol)
    initial = [np.asarray(w) for w in __import__("resume_script").build().get_weights()]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(expected, initial)) > 1e-2
    assert running(str(tmp_path)) == []
