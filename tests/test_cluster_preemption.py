"""Preemption across processes started by a cluster's launcher (srun fakes).

Two processes of `tests/resume_script.py` as `srun -n 2` starts them (no
launcher of ours; `cluster_launchers.start_two`). At epoch 2, batch 3 one
process sends itself SIGTERM, as a scheduler would to one task:

- every process exits with 75 within 60 s of the signal, no process left;
- the backup was written at the agreed step (mid-epoch);
- the same command, run again, resumes and ends with the weights of an
  uninterrupted run (1e-5, against one device, in this process: JAX with
  dropout; torch without, its ranks drawing their own masks; 1e-6
  TensorFlow, against the same two workers uninterrupted), every batch
  split over the devices in both runs (`split_probe`);
- JAX and torch: the same backup, resumed in this one process (JAX's 8
  devices, torch's one), ends with the same weights, says what it resumed
  from, and splits its batches over the devices it has now (another
  topology; TensorFlow's, half its devices: tests/test_backup.py).

JAX: 2 processes x 4 devices; torch: 2 processes; TensorFlow: 2 workers x 2
devices, which divide a `PyDataset`'s batches (made round-robin, resumed
mid-epoch; arrays on JAX and torch, whose divided PyDataset resumes in
`tests/test_faults.py`).
"""

import json
import re
import shutil
import time

import keras
import numpy as np
import pytest
import resume_script
from cluster_launchers import exit_codes, max_rel, start_two
from split_probe import assert_divided, clear, records

BACKEND = keras.backend.backend()
#: Per backend: consecutive free ports, the processes' variables, how many
#: ways each batch is split, the tolerance against one device.
SETUPS = {
    "jax": (1, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, 8, 1e-5),
    "torch": (1, {"KERAS_PARALLEL_TIMEOUT": "60", "RESUME_DROPOUT": "0"}, 2, 1e-5),
    "tensorflow": (
        3,
        {
            "KERAS_PARALLEL_DEVICES_PER_PROCESS": "2",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            # The workers divide a PyDataset's batches and resume it
            # mid-epoch (JAX and torch: tests/test_faults.py).
            "RESUME_INPUT": "pydataset",
        },
        4,
        1e-6,
    ),
}
PORTS, VARIABLES, WAYS, TOLERANCE = SETUPS[BACKEND]
#: The global batch: 32 rows of arrays, 16 of the PyDataset.
GLOBAL_BATCH = 16 if VARIABLES.get("RESUME_INPUT") == "pydataset" else 32


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    if BACKEND in ("jax", "torch"):
        # One device: a launch fewer (torch's ranks without dropout).
        model = resume_script.build(distributed=False, dropout=BACKEND == "jax")
        resume_script.train(model)
        return [np.asarray(w) for w in model.get_weights()]
    reference = tmp_path_factory.mktemp("reference")
    done = run(reference)
    assert exit_codes(done) == [0, 0], done.stderr[-5000:]
    return final_weights(reference)


def final_weights(out):
    with np.load(out / "weights.npz") as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def run(out, *args):
    return start_two(
        out,
        "srun",
        BACKEND,
        PORTS,
        script="resume_script.py",
        args=(out / "backup", *args),
        **VARIABLES,
    )


# SIGTERM across processes, the signal JAX's runtime also handles (the watch
# must stand in front of it); SIGUSR1, which no runtime handles, takes the
# same path once caught, and both signals are caught in one process on
# every backend (test_preemption).
SIGNAL_NAMES = ["SIGTERM"]


@pytest.mark.parametrize("signal_name", SIGNAL_NAMES)
def test_a_signal_to_one_process_stops_all_and_the_same_command_resumes(
    tmp_path, uninterrupted, signal_name, capsys
):
    preempted = run(tmp_path, f"{signal_name}:1")
    ended = time.time()
    assert exit_codes(preempted) == [75, 75], preempted.stderr[-5000:]
    signalled_at = float((tmp_path / "killpoint").read_text().split()[1])
    assert ended - signalled_at < 60
    assert f"preempted ({signal_name} reached process 1)" in preempted.stderr
    if GLOBAL_BATCH == 16:
        assert "Input: PyDataset, batches made round-robin" in preempted.stdout
    metadata = json.loads((tmp_path / "backup/training_metadata.json").read_text())
    # Signalled after batch 3 of epoch 2: the processes stop there, or one
    # batch later where the other had already answered batch 3.
    assert metadata["epoch"] == 2
    assert metadata["keras_parallel"]["steps_done"] in (4, 5), metadata
    if BACKEND in ("jax", "torch"):
        one_process = tmp_path / "resumed-in-one-process"
        shutil.copytree(tmp_path / "backup", one_process)
        resume_in_this_process(one_process, uninterrupted, capsys)

    resumed = run(tmp_path, f"{signal_name}:1")  # The same command.
    assert exit_codes(resumed) == [0, 0], resumed.stderr[-5000:]
    assert max_rel(final_weights(tmp_path), uninterrupted) <= TOLERANCE
    for run_index in (0, 1):
        for rank in (0, 1):
            records = json.loads(
                (tmp_path / f"records{rank}-{run_index}.json").read_text()
            )
            assert_divided([tuple(r) for r in records], GLOBAL_BATCH, WAYS)


def resume_in_this_process(directory, uninterrupted, capsys):
    """Resumes the 2 processes' backup in this process, on every device it
    has (JAX: 8 devices, as 2 x 4 were; torch: 1 device, as 2 were): the
    uninterrupted run's weights, the batches split over the devices now."""
    model = resume_script.build(probe=True, dropout=BACKEND == "jax")
    clear()
    capsys.readouterr()
    resume_script.train(model, [keras.callbacks.BackupAndRestore(str(directory))])
    devices = len(keras.distribution.list_devices())
    made_on = {"jax": "8 devices in 2 processes", "torch": "2 devices in 2 processes"}
    now = f"{devices} device{'s' * (devices != 1)} in 1 process"
    assert re.search(
        rf"keras_parallel: resumed in epoch 3 after [45] batches, from a backup "
        rf"made on {made_on[BACKEND]}; now {now}",
        capsys.readouterr().out,
    )
    assert_divided(records(), GLOBAL_BATCH, devices)
    weights = [np.asarray(w) for w in model.get_weights()]
    assert max_rel(weights, uninterrupted) <= TOLERANCE
