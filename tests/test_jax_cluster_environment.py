"""JAX started by a cluster's own launcher: `srun`, `mpirun`, no launcher of ours.

Two processes x 4 simulated CPU devices, each given only its launcher's
variables (faked, `tests/cluster_launchers.py`), must form one 8-device
runtime as soon as the unchanged script imports Keras
(`keras_parallel._join_cluster` -> `backends/jax/runtime.py`): after one
step both hold single-device training's weights (1e-5), with process 0's
initial weights, and each device computed 8 rows of the 64-row batch.
Without the joining, the same processes train alone and the checks fail.

Then the join's rules, each in a process of its own (`cluster_join_probe.py`,
`cluster_join_script.py`): both import orders join; a plain machine, an
`sbatch` script, a child of a joined process and a `multiprocessing` child
join nothing; a failed join names itself, offers the opt-out and fails
again; a rank that raises after the join ends both processes at once.
"""

import json
import os
import re
import sys
import time

import keras
import pytest
from cluster_launchers import SLURM_TASK_1_OF_2_NODES

from keras_parallel.backends.jax import runtime

on_jax = keras.backend.backend() == "jax"
#: Processes of their own: on the JAX backend only (tox -e jax).
jax_only = pytest.mark.skipif(not on_jax, reason="JAX processes (tox -e jax)")
multi_process = jax_only

if on_jax:
    import cluster_launchers
    from cluster_launchers import (
        assert_plan_names_the_cluster,
        bare_env,
        free_port_run,
        one_process_reference,
        results,
        slurm,
        start_two,
    )
    from split_probe import assert_divided
    from subprocesses import gone, run_in_session

HERE = os.path.dirname(os.path.abspath(__file__))

DEVICES = "--xla_force_host_platform_device_count=4"


@pytest.fixture(scope="module")
def one_device():
    return one_process_reference()


def check_one_group(out, one_device):
    cluster_launchers.check_one_group(out, one_device, 8)


@multi_process
# One launcher a backend, each launcher on one backend (JAX mpirun, torch
# torchelastic, TensorFlow srun): the join reads one `ClusterEnvironment`
# whatever set it, and each launcher's variables are read in
# tests/test_cluster_environments.py. mpirun here: the script also calls
# `keras.distribution.initialize()`.
@pytest.mark.parametrize("launcher", ["mpirun"])
def test_two_processes_train_as_one_group(tmp_path, one_device, launcher):
    # Under mpirun the script also calls `keras.distribution.initialize()`.
    initializes = "1" if launcher == "mpirun" else "0"
    done = start_two(
        tmp_path,
        launcher,
        "jax",
        # torchelastic: JAX's coordinator on MASTER_PORT + 1.
        ports=2 if launcher == "torchelastic" else 1,
        XLA_FLAGS=DEVICES,
        SCRIPT_INITIALIZES=initializes,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    check_one_group(tmp_path, one_device)
    assert_plan_names_the_cluster(results(tmp_path)[1], launcher)


@multi_process
def test_without_joining_each_process_trains_alone(tmp_path, one_device):
    """The red case: the checks above must catch it, within the timeout."""
    done = start_two(tmp_path, "srun", "jax", 1, joined=False, XLA_FLAGS=DEVICES)
    assert done.returncode == 0, done.stderr[-4000:]
    weights, infos = results(tmp_path)
    assert [info["devices"] for info in infos] == [4, 4]
    with pytest.raises(AssertionError, match="not split"):
        assert_divided([tuple(r) for r in infos[0]["records"]], 64, 8)
    with pytest.raises(AssertionError):
        check_one_group(tmp_path, one_device)


SLURM = SLURM_TASK_1_OF_2_NODES


def test_cluster_arguments_come_from_the_detected_environment():
    assert runtime.cluster_arguments(SLURM) == {
        "coordinator_address": "node01:18456",  # 15000 + 3456
        "num_processes": 2,
        "process_id": 1,
    }
    openmpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    openmpi.update(OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_PORT="4567")
    assert runtime.cluster_arguments(openmpi)["coordinator_address"] == (
        "127.0.0.1:4567"
    )
    assert runtime.wanted(SLURM)


def test_one_process_or_a_bare_machine_starts_nothing():
    assert runtime.cluster_arguments({}) is None
    assert (
        runtime.cluster_arguments(
            dict(SLURM, SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")
        )
        is None
    )
    assert not runtime.wanted({})
    assert not runtime.wanted(dict(SLURM, SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0"))


def test_keras_own_variables_win_over_the_launchers():
    """Under `keras-parallel launch`, what it set (inside an srun job too)."""
    environ = dict(
        SLURM,
        KERAS_DISTRIBUTION_JOB_ADDRESSES="10.0.0.1:1234",
        KERAS_DISTRIBUTION_NUM_PROCESSES="4",
        KERAS_DISTRIBUTION_PROCESS_ID="3",
    )
    assert runtime.cluster_arguments(environ) == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
    }


def test_the_environment_is_read_from_os_environ_by_default(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "KERAS_DISTRIBUTION_")):
            monkeypatch.delenv(name)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert runtime.cluster_arguments() is None
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert runtime.cluster_arguments()["process_id"] == 1


@jax_only
def test_a_scripts_own_initialize_after_ours_runs(monkeypatch):
    """`keras.distribution.initialize()` agreeing with the running runtime.

    In this process: JAX's process count and index are faked (no runtime
    is started); the JAX backend is needed for Keras's JAX `initialize`.
    """
    import jax

    from keras_parallel.backends.jax import initialize_once
    from keras_parallel.backends.jax.keras_compat import distribution_lib

    original = distribution_lib.initialize
    for name in ("JOB_ADDRESSES", "NUM_PROCESSES", "PROCESS_ID"):
        monkeypatch.delenv(f"KERAS_DISTRIBUTION_{name}", raising=False)
    try:
        assert initialize_once.install() is initialize_once.install()  # Once.
        # As in process 1 of 2 once keras_parallel started the runtime.
        monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(jax, "process_index", lambda: 1)
        keras.distribution.initialize()
        keras.distribution.initialize("10.0.0.1:1234", 2, 1)
        with pytest.raises(ValueError, match=r"Received: \{'process_id': 0\}"):
            keras.distribution.initialize("10.0.0.1:1234", 2, 0)
    finally:
        initialize_once._kept.restore()
    assert distribution_lib.initialize is original


# The join's rules, each in a process of its own.

#: The batch script of `sbatch --ntasks=2`: the allocation's task count,
#: rank 0's variables, and no srun step (no SLURM_STEP_ID).
SBATCH = {
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "127.0.0.1",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_JOB_NAME": "train",
}


def srun_task(rank):
    """The variables of task `rank` of a fake `srun -n 2`, on a free port."""
    shared, per_rank = slurm(free_port_run(1))
    return {**shared, **{k: str(v) for k, v in per_rank(rank).items()}}


def probe(tmp_path, mode, timeout=90, **variables):
    """Runs `cluster_join_probe.py MODE` with only `variables` of a launcher.

    Returns:
        `(its JSON line, stderr, seconds)`.
    """
    command = [sys.executable, os.path.join(HERE, "cluster_join_probe.py"), mode]
    env = bare_env(KERAS_BACKEND="jax", XLA_FLAGS=DEVICES, **variables)
    started = time.monotonic()
    try:
        # `tmp_path` in its command line: how `gone` finds a leftover.
        done = run_in_session([*command, str(tmp_path)], env, timeout)
    finally:
        assert not gone(str(tmp_path)), "a process outlived the test"
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[0]), done.stderr, seconds


@jax_only
@pytest.mark.timeout(180)
def test_a_plain_machine_joins_nothing(tmp_path):
    """No launcher's variable: importing Keras starts no `jax.distributed`."""
    found, _, _ = probe(tmp_path, "record")
    assert found["backend"] == "jax"
    assert found["calls"] == []
    assert not found["initialized"]
    assert found["joined_pid"] is None
    assert not found["excepthook_replaced"]


@jax_only
@pytest.mark.timeout(180)
def test_an_sbatch_script_runs_alone_at_once_and_warns(tmp_path):
    """Not a task of srun: no waiting (300 s) for tasks nobody started."""
    found, stderr, seconds = probe(
        tmp_path, "real", timeout=60, SLURM_JOB_ID="123456", **SBATCH
    )
    assert seconds < 60
    assert not found["initialized"]
    assert found["joined_pid"] is None
    assert "NotStartedBySrunWarning" in stderr
    assert "srun python train.py" in stderr


@jax_only
@pytest.mark.timeout(240)
def test_a_child_of_a_joined_process_joins_nothing(tmp_path):
    """A subprocess inherits its parent's rank, and the marker naming its parent."""
    task = srun_task(1)
    # The same variables without the marker: the probe sees a join.
    found, _, _ = probe(tmp_path, "record", **task)
    assert found["calls"] == [
        {
            "coordinator_address": f"127.0.0.1:{15000 + int(task['SLURM_JOB_ID'][-4:])}",
            "num_processes": 2,
            "process_id": 1,
        }
    ]
    assert found["joined_pid"] == str(found["pid"])
    found, _, _ = probe(tmp_path, "record", KERAS_PARALLEL_JOINED_PID="1", **task)
    assert found["calls"] == []
    assert found["joined_pid"] == "1"


@jax_only
@pytest.mark.timeout(180)
def test_a_multiprocessing_child_joins_nothing(tmp_path):
    """A spawn worker of a process started by srun: it would take rank 1 again."""
    found, _, _ = probe(tmp_path, "spawn", **srun_task(1))
    assert found["calls"] == []
    assert found["joined_pid"] is None


@jax_only
@pytest.mark.timeout(240)
def test_a_failed_join_names_itself_offers_the_opt_out_and_fails_again(tmp_path):
    """JAX refuses to start after a device query: its error, wrapped."""
    found, _, _ = probe(tmp_path, "devices_first", **srun_task(0))
    first, second = found["errors"]
    assert first["type"] == "ClusterJoinError"
    assert "keras_parallel's cluster join failed" in first["message"]
    assert "KERAS_PARALLEL_CLUSTER=off" in first["message"]
    assert "slurm (world size 2, rank 0" in first["message"]
    assert first["cause"] == "RuntimeError"
    assert "must be called before any JAX calls" in first["cause_message"]
    assert second == first  # The second `import keras` fails too.
    found, _, _ = probe(
        tmp_path, "devices_first", KERAS_PARALLEL_CLUSTER="off", **srun_task(0)
    )
    assert found["errors"] == [None, None]
    assert not found["initialized"]


def start_join_script(out, *args, timeout):
    """`cluster_join_script.py` with `args`, in two processes as srun starts them."""
    return start_two(
        out,
        "srun",
        "jax",
        ports=1,
        script="cluster_join_script.py",
        args=args,
        timeout=timeout,
        XLA_FLAGS=DEVICES,
    )


@jax_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["keras_parallel_first", "keras_first"])
def test_both_import_orders_join(tmp_path, order):
    done = start_join_script(tmp_path, order, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    # Found anywhere in stdout: Gloo's C++ messages, unbuffered, can land in
    # the middle of the other process's line (seen once).
    lines = [json.loads(x) for x in re.findall(r'\{[^{}]*"rank"[^{}]*\}', done.stdout)]
    assert sorted(line["rank"] for line in lines) == [0, 1], done.stdout
    for line in lines:
        assert (line["processes"], line["devices"], line["marked"]) == (2, 8, True)


@jax_only
@pytest.mark.timeout(180)
def test_a_rank_that_raises_ends_both_processes_at_once(tmp_path):
    """Rank 1 raises while rank 0 waits for it in a collective that has run
    before (as a `fit` step has).

    Without keras_parallel's excepthook, rank 1 would wait at JAX's
    shutdown barrier for rank 0, which waits for rank 1: 300 s.
    """
    started = time.monotonic()
    done = start_join_script(tmp_path, "keras_parallel_first", 1, timeout=60)
    assert time.monotonic() - started < 60
    assert done.returncode != 0
    assert "keras_parallel: rank 1 of 2 raised the error below" in done.stderr
    assert "RuntimeError: rank 1 raises after the join" in done.stderr


@multi_process
def test_mpirun_processes_on_one_host_listen_on_loopback_only(tmp_path):
    # JAX's coordination service binds every interface (`[::]`) unless told:
    # the join binds the address the first process is reached at.
    from listening_sockets import assert_loopback_only, sockets_while_in_fit

    argv, env = cluster_launchers.command_of_two(
        tmp_path,
        "mpirun",
        "jax",
        1,
        script="listening_script.py",
        KP_WAIT_S="3",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    assert_loopback_only(*sockets_while_in_fit(argv, env, tmp_path, 2, 240))
