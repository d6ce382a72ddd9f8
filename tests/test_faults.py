"""Faults across processes: killed, stopped, restarted; backups resume exactly.

`tests/resume_script.py` trains with `keras.callbacks.BackupAndRestore`, a
shuffled uneven epoch and seeded dropout. It is killed in the middle of
epoch 2 (the launcher with SIGKILL, which gives it no chance to end its
processes: they end with it, by the kernel's SIGKILL; one process with
SIGKILL; the launcher with SIGTERM or SIGINT), and

- every process ends within the time allowed, the launcher exits non-zero
  naming the rank, and no process is left (counted);
- the same command run again (or restarted by `--max-restarts`) ends with
  the weights of an uninterrupted run. Keras's own `BackupAndRestore`
  resumes with another shuffle (6e-2 apart here): keras_parallel keeps the
  random state in the backup (`keras_parallel.persistence.backup`).

One JAX process with 8 devices, 2 JAX processes x 4 devices, 2 torch
processes. The preempted launcher's run trains on a `PyDataset` whose
batches the processes make round-robin (divided input) and resumes it
mid-epoch. Every launch has a hard timeout.
"""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from split_probe import assert_divided
from subprocesses import checkout_env, gone, run_in_session, running

from keras_parallel.persistence import backup as backup_module

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")
TIMEOUT_S = 240
BACKEND = keras.backend.backend()

# TensorFlow workers share the launcher's supervisor with JAX: a killed
# worker is tested there too (TensorFlow's own collectives must not hang on
# it); the restart, the supervisor's alone, and the rest on JAX and torch.
jax_and_torch = pytest.mark.skipif(
    BACKEND not in ("jax", "torch"), reason="tested on JAX and torch"
)


#: torch's ranks each draw their own dropout masks: its runs train without
#: dropout, and equal one device in this process (a launch fewer).
DROPOUT = BACKEND != "torch"


def script_env(**variables):
    """The launched script's environment: this checkout, this backend."""
    if not DROPOUT:
        variables.setdefault("RESUME_DROPOUT", "0")
    return checkout_env(KERAS_BACKEND=BACKEND, **variables)


def command(processes, *args, restarts=0):
    if processes == 1:
        return [sys.executable, SCRIPT, *map(str, args)]
    options = ["--nproc-per-node", str(processes)]
    if restarts:
        options += ["--max-restarts", str(restarts)]
    if BACKEND == "jax":
        options += ["--devices-per-process", "4"]
    if BACKEND == "tensorflow":
        options += ["--allow-reachable-workers"]
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
    result = run_in_session(command(processes, *args), script_env(), TIMEOUT_S)
    return result


def kill_the_launcher_at_killpoint(processes, out, backup):
    """Starts the run, waits for process 0 at the kill point, SIGKILLs the
    launcher alone (as the OOM killer or `kill -9` would): every process
    it started must end with it, within 10 s (`launcher/parent_death.py`)."""
    process = subprocess.Popen(
        command(processes, out, backup, "wait"),
        env=script_env(),
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
        ranks = [pid for pid in running(str(out)) if pid != process.pid]
        assert len(ranks) == processes, ranks
        process.kill()
        process.wait(timeout=30)
        left = gone(str(out), timeout=10)
    finally:
        # Whatever is left is ended here, so that a failure leaves nothing.
        for pid in running(str(out)):
            os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stderr.close()
    assert left == [], f"still running 10 s after their launcher was killed: {left}"


def final_weights(out):
    with np.load(os.path.join(out, "weights.npz")) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k[4:]))]


def reference_in_process(source="arrays"):
    """One run in this process: JAX on its 8 devices, torch on one."""
    import resume_script

    model = resume_script.build(distributed=BACKEND == "jax", dropout=DROPOUT)
    resume_script.train(model, source=source)
    return [np.asarray(w) for w in model.get_weights()]


def assert_weights_equal(actual, expected, rtol):
    assert expected, "no weights to compare"
    for a, b in zip(actual, expected, strict=True):
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
    for a, b in zip(final_weights(tmp_path), expected, strict=True):
        np.testing.assert_array_equal(a, b)


def uninterrupted_run(source="arrays"):
    """The final weights of an uninterrupted run in this process, and the
    tolerance: 2 x 4 JAX devices train as 1 x 8, 2 torch ranks as one
    device (without dropout)."""
    return reference_in_process(source), 1e-5


@pytest.fixture(scope="module")
def uninterrupted():
    return uninterrupted_run()


def start(processes, out, *args, **variables):
    """Starts the script in a session of its own; returns the Popen."""
    return subprocess.Popen(
        command(processes, out, *args),
        env=script_env(**variables),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_killpoint(process, out):
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(os.path.join(out, "killpoint")):
        if process.poll() is not None:
            return  # Ended (killed itself) before the test saw the marker.
        assert time.monotonic() < deadline, "never reached the kill point"
        time.sleep(0.2)


def finish(process, timeout):
    """Waits `timeout` s for the launcher; kills its session if it overruns.

    Returns:
        `(exit code, stderr, seconds waited)`.
    """
    began = time.monotonic()
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = process.communicate()
        pytest.fail(f"still running {timeout} s after the fault:\n{err[-3000:]}")
    return process.returncode, err, time.monotonic() - began


def resume_and_compare(out, backup, uninterrupted):
    resumed = run(2, out, backup)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected, rtol = uninterrupted
    assert_weights_equal(final_weights(out), expected, rtol)
    assert running(str(out)) == []


@jax_and_torch
def test_a_killed_launcher_takes_every_process_with_it_and_the_run_resumes_exactly(
    tmp_path, uninterrupted
):
    # Every process ends by SIGKILL, the kernel's (its launcher's death):
    # the backup they left resumes exactly.
    backup = tmp_path / "backup"
    kill_the_launcher_at_killpoint(2, tmp_path, backup)
    resume_and_compare(tmp_path, backup, uninterrupted)
    expected, _ = uninterrupted
    initial = [np.asarray(w) for w in __import__("resume_script").build().get_weights()]
    assert (
        max(
            float(np.max(np.abs(a - b))) for a, b in zip(expected, initial, strict=True)
        )
        > 1e-2
    )


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="JAX: test_max_restarts_restarts_the_group_and_resumes_exactly kills a "
    "process, names it and ends the others before it restarts them (torch's "
    "restarts are torchrun's agent's)",
)
def test_one_process_killed_ends_every_process(tmp_path):
    process = start(2, tmp_path, tmp_path / "backup", "self")
    wait_for_killpoint(process, tmp_path)
    code, err, seconds = finish(process, 60)
    assert code != 0
    assert seconds < 60
    name = {"torch": "rank 0", "tensorflow": "worker 0"}.get(BACKEND, "process 0")
    # The process killed itself with SIGKILL: no traceback to point to.
    assert f"{name} was killed by signal 9 (SIGKILL)" in err, err[-3000:]
    assert running(str(tmp_path)) == []


# SIGTERM: JAX's processes only record it (a preemption) and, stuck in a
# callback, are killed by the launcher after the grace. SIGINT (Ctrl-C) to
# JAX's launcher takes the same path in its supervisor, passed on to every
# process: test_cli's supervisor test, without a launch.
SIGNALS = [signal.SIGTERM]


@jax_and_torch
@pytest.mark.parametrize("signum", SIGNALS)
def test_stopped_launcher_ends_every_process_and_keeps_its_backup(tmp_path, signum):
    backup = tmp_path / "backup"
    # The processes wait inside a callback and never reach the batch end
    # where SIGTERM's preemption would stop them: the launcher ends them
    # after the grace (here 1 s, + 10; torchrun's agent: its own 30 s).
    process = start(2, tmp_path, backup, "wait", KERAS_PARALLEL_PREEMPTION_GRACE="1")
    wait_for_killpoint(process, tmp_path)
    os.kill(process.pid, signum)
    code, err, seconds = finish(process, 30)
    assert code != 0
    assert running(str(tmp_path)) == [], err[-3000:]
    # The processes ended without a write, as a killed launcher's do: the
    # backup of epoch 1's end stays, as the one that resumes exactly in
    # `test_a_killed_launcher_takes_every_process_with_it_...` (a resume is
    # a second launch).
    metadata = json.load(open(backup / "training_metadata.json"))
    assert (metadata["epoch"], metadata["keras_parallel"]["steps_done"]) == (2, 0)


#: The stall timeout of the stall tests: short, and shorter than the
#: processes' alike sleep (`ALIKE_SLEEP`), which must not fire it; longer
#: than one process's step can lag another's on busy cores (a compile of
#: the epoch's last, uneven batch finished seconds apart: with 4 s, one
#: such lag was taken for a stall in a CI run with two envs at once).
STALL_TIMEOUT_S = 10


def stalled_run(tmp_path, kill, alike_first=False, **variables):
    """Launches the script with `kill` (a stall of process 1) under a short
    stall timeout (with `alike_first`, every process first sleeping alike
    for longer than it); returns `(exit code, stderr)` once the launcher
    ended."""
    if alike_first:
        variables["ALIKE_SLEEP"] = str(STALL_TIMEOUT_S + 4)
    process = start(
        2,
        tmp_path,
        tmp_path / "backup",
        kill,
        KERAS_PARALLEL_STALL_TIMEOUT=str(STALL_TIMEOUT_S),
        **variables,
    )
    code, err, _ = finish(process, TIMEOUT_S)
    assert running(str(tmp_path)) == [], err[-3000:]
    return code, err


def assert_names_process_1(err, asleep_in):
    name = {"torch": "rank", "tensorflow": "worker"}.get(BACKEND, "process")
    lines = [line for line in err.splitlines() if "stalled" in line]
    report = next(line for line in lines if line.startswith("keras_parallel: "))
    assert report.startswith("keras_parallel: process 1 (host "), err[-4000:]
    assert "pid " in report and "exit code 77" in report, report
    # Its stack, every thread, down to where it sleeps; then the other's.
    after = err[err.index(report) :]
    assert "Process 1's stack, every thread:" in after
    assert f"in {asleep_in}" in after, after[-4000:]
    assert "process 0 (host " in after and "waits in " in after, after[-4000:]
    assert f"keras-parallel launch: {name} 1 stalled" in err, err[-3000:]
    return report


def test_a_process_asleep_in_a_callback_is_named_and_every_process_ends(tmp_path):
    # Every process asleep alike at epoch 1 (longer than the timeout) is no
    # stall; process 1 asleep at epoch 2, batch 3 while process 0 waits in
    # the next step is: named with its stack, every process ended, exit
    # code 77, the last backup left as it was (epoch 2's: processes ended
    # without a write, as a killed run's, whose backup resumes exactly:
    # test_a_killed_launcher_takes_every_process_with_it_...).
    code, err = stalled_run(tmp_path, "wait:1", alike_first=True)
    assert code == 77, err[-4000:]
    report = assert_names_process_1(err, "asleep_in_a_callback")
    assert "after training batch 3 of epoch 2 ended" in report, report
    assert err.count("Process 1's stack") == 1  # One report.
    metadata = json.load(open(tmp_path / "backup" / "training_metadata.json"))
    # Written at epoch 1's end: it resumes at epoch 2's first batch.
    assert (metadata["epoch"], metadata["keras_parallel"]["steps_done"]) == (2, 0)


#: What a process is asleep making its batch from, per backend, and where
#: its stack shows it: a `PyDataset` whose batches the processes make
#: round-robin (every backend), and torch's `DataLoader` worker.
MAKING_A_BATCH = {
    "jax": [("pydataset", "asleep_making_a_batch")],
    "torch": [
        ("pydataset", "asleep_making_a_batch"),
        # Rank 1's main thread waits for its worker, asleep in `__getitem__`.
        ("dataloader", "_get_data"),
    ],
    "tensorflow": [("pydataset", "asleep_making_a_batch")],
}[BACKEND]


@pytest.mark.parametrize("source, asleep_in", MAKING_A_BATCH)
def test_a_process_asleep_making_its_batch_is_named(tmp_path, source, asleep_in):
    # Process 1 asleep in the `__getitem__` of its part of a PyDataset's
    # batches, process 0 waiting for that part at the same step of Keras's
    # loop; or rank 1's DataLoader worker asleep, rank 1 waiting for it
    # before its next batch (the worker ends with its rank: no process left).
    code, err = stalled_run(tmp_path, "getitem:1", RESUME_INPUT=source)
    assert code == 77, err[-4000:]
    assert_names_process_1(err, asleep_in)


def test_a_forged_stop_notice_is_refused_on_every_process_and_none_stops(tmp_path):
    # Process 1 writes a stop notice under the run's real key without the
    # run's tag, as anyone who reached the store could: refused (naming
    # the key), no process stops at an agreed step as a preemption would
    # (exit code 75), every process ends.
    process = start(2, tmp_path, tmp_path / "backup", "forge:1")
    code, err, _ = finish(process, TIMEOUT_S)
    assert code not in (0, 75), err[-4000:]
    assert "UntrustedValueError" in err, err[-4000:]
    assert "keras_parallel/stop/1/notice" in err, err[-4000:]
    assert "preempted" not in err, err[-4000:]
    assert running(str(tmp_path)) == []


@jax_and_torch
def test_max_restarts_restarts_the_group_and_resumes_exactly(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    result = run_in_session(
        command(2, tmp_path, backup, "self", restarts=1),
        script_env(),
        TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert os.path.exists(tmp_path / "killpoint")  # It was killed once.
    if BACKEND == "jax":
        # Named (no traceback to point to), the others ended, restarted.
        assert "process 0 was killed by signal 9 (SIGKILL)" in result.stderr
        assert "restart 1 of 1" in result.stderr
    expected, rtol = uninterrupted
    assert_weights_equal(final_weights(tmp_path), expected, rtol)
    assert running(str(tmp_path)) == []


@jax_and_torch
def test_a_preempted_launcher_stops_every_process_at_one_step_and_resumes(
    tmp_path,
):
    # A scheduler's SIGTERM to `keras-parallel launch` reaches every
    # process, which stop at one step with the backup written (exit code
    # 75); the launcher exits with 75 and does not restart them.
    # The input is a shuffled PyDataset, whose batches the processes make
    # round-robin and exchange (divided input): resumed mid-epoch, each
    # process passes over the batches already trained as one device does.
    backup = tmp_path / "backup"
    env = script_env(RESUME_INPUT="pydataset")
    result = run_in_session(
        command(2, tmp_path, backup, "SIGTERM:launcher", restarts=1), env, TIMEOUT_S
    )
    assert result.returncode == 75, result.stderr[-4000:]
    assert "preempted: every " in result.stderr
    assert "stopped at the same step" in result.stderr
    assert "restart" not in result.stderr.lower(), result.stderr[-4000:]
    metadata = json.load(open(backup / "training_metadata.json"))
    # The step the processes agreed on: in epoch 2 (mid-epoch) where the
    # agreement lands within its 13 steps, as on an idle machine; on a busy
    # one it may land at the epoch's end (the backup then starts epoch 3).
    steps_done = metadata[backup_module.METADATA_KEY]["steps_done"]
    assert (metadata["epoch"], steps_done >= 4) in ((2, True), (3, False)), metadata
    assert "Input: PyDataset, batches made round-robin" in result.stdout
    assert running(str(tmp_path)) == []
    # torch resumes on 4 ranks (another topology: the same global batches,
    # split 4 ways, its PyDataset's batches made round-robin by 4); JAX's
    # 2 processes resume as 1 in tests/test_cluster_preemption.py.
    processes = 4 if BACKEND == "torch" else 2
    resumed = run_in_session(command(processes, tmp_path, backup), env, TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    if BACKEND == "torch":
        assert (
            "from a backup made on 2 devices in 2 processes; now 4 devices in 4 "
            "processes"
        ) in resumed.stdout, resumed.stdout[-3000:]
    expected, rtol = uninterrupted_run("pydataset")
    assert_weights_equal(final_weights(tmp_path), expected, rtol)
    # Both runs split every batch of 16 (8 devices on JAX; 2 ranks, then 4).
    for run_index, ranks in ((0, 2), (1, processes)):
        ways = 8 if BACKEND == "jax" else ranks
        for rank in range(ranks):
            path = tmp_path / f"records{rank}-{run_index}.json"
            assert_divided([tuple(r) for r in json.loads(path.read_text())], 16, ways)
    assert running(str(tmp_path)) == []
