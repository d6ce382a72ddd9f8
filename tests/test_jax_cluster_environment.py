"""JAX started by a cluster's own launcher: `srun`, `mpirun`, no launcher of ours.

Two processes x 4 simulated CPU devices, each given only its launcher's
variables (faked, `tests/cluster_launchers.py`), must form one 8-device
runtime as soon as the unchanged script imports Keras
(`keras_parallel._join_cluster` -> `backends/jax/runtime.py`): after one
step both hold single-device training's weights (1e-5), with process 0's
initial weights, and each device computed 8 rows of the 64-row batch.
Without the joining, the same processes train alone and the checks fail.
"""

import os

import keras
import pytest

from keras_parallel.backends.jax import runtime

multi_process = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX processes (tox -e jax)"
)

if keras.backend.backend() == "jax":
    import cluster_environment_script as script
    from cluster_launchers import max_rel, results, start_two
    from split_probe import assert_divided

DEVICES = "--xla_force_host_platform_device_count=4"


@pytest.fixture(scope="module")
def one_device():
    model = script.build(seed=1, distributed=False)  # Process 0's seed.
    script.train(model)
    return [keras.ops.convert_to_numpy(v.value) for v in model.weights]


def check_one_group(out, one_device):
    weights, infos = results(out)
    for rank in (0, 1):
        assert infos[rank]["devices"] == 8, infos[rank]
        assert_divided([tuple(r) for r in infos[rank]["records"]], 64, 8)
        assert max_rel(weights[rank], one_device) < 1e-5


@multi_process
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_two_processes_train_as_one_group(tmp_path, one_device, launcher):
    # Under mpirun the script also calls `keras.distribution.initialize()`.
    initializes = "1" if launcher == "mpirun" else "0"
    done = start_two(
        tmp_path,
        launcher,
        "jax",
        ports=1,
        XLA_FLAGS=DEVICES,
        SCRIPT_INITIALIZES=initializes,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    check_one_group(tmp_path, one_device)


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


SLURM = {
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_JOB_ID": "123456",
}


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
        runtime.cluster_arguments(dict(SLURM, SLURM_NTASKS="1", SLURM_PROCID="0"))
        is None
    )
    assert not runtime.wanted({})
    assert not runtime.wanted(dict(SLURM, SLURM_NTASKS="1", SLURM_PROCID="0"))


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


@multi_process
def test_a_scripts_own_initialize_after_ours_runs(monkeypatch):
    """`keras.distribution.initialize()` agreeing with the running runtime."""
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
