"""TensorFlow started by a cluster's own launcher: `srun`, `mpirun`, no launcher of ours.

Two workers x 2 logical CPU devices, each given only its launcher's
variables (faked, `tests/cluster_launchers.py`) and no `TF_CONFIG`, must
form one 4-replica `MultiWorkerMirroredStrategy` as soon as the unchanged
script imports Keras (`keras_parallel._join_cluster` ->
`backends/tensorflow/workers.py`, `TF_CONFIG` computed from the launcher's
variables): after one step both hold single-device training's weights
(1e-5), with worker 0's initial weights, and each replica computed 16 rows
of the 64-row batch. Without the joining, the workers fail at once.

Then, each in a process of its own: with no cluster, importing Keras
imports no module of the TensorFlow backend (and so none of its checks of
Keras's internals: an unsupported Keras still imports); with one, such a
check's error and a `TF_CONFIG` of other roles than workers fail the import
with the join's error. Last, a worker that raises after the join is named,
and both end within seconds.
"""

import json
import os
import sys
import time

import keras
import pytest
from cluster_launchers import SLURM_TASK_1_OF_2_NODES

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow workers (tox -e tensorflow)",
)

if keras.backend.backend() == "tensorflow":
    import cluster_launchers
    from cluster_launchers import (
        assert_plan_names_the_cluster,
        bare_env,
        exit_codes,
        one_process_reference,
        results,
        start_two,
    )
    from subprocesses import gone, run_in_session

    from keras_parallel.backends.tensorflow import workers

#: Each worker's CPU split in two; TensorFlow's INFO lines hidden.
VARIABLES = {"KERAS_PARALLEL_DEVICES_PER_PROCESS": "2", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture(scope="module")
def one_device():
    return one_process_reference()


def check_one_group(out, one_device):
    # This worker's 2 replicas recorded a step each.
    cluster_launchers.check_one_group(out, one_device, 4, records_per_process=2)


# One launcher a backend, each launcher on one backend (JAX mpirun, torch
# torchelastic, TensorFlow srun): the join reads one `ClusterEnvironment`
# whatever set it, and each launcher's variables are read in
# tests/test_cluster_environments.py.
@pytest.mark.parametrize("launcher", ["srun"])
def test_two_workers_train_as_one_group(tmp_path, one_device, launcher):
    # The main port and each worker's: main + 1 + its index on the host.
    done = start_two(tmp_path, launcher, "tensorflow", ports=3, **VARIABLES)
    assert done.returncode == 0, done.stderr[-4000:]
    check_one_group(tmp_path, one_device)
    assert_plan_names_the_cluster(results(tmp_path)[1], launcher)


def test_without_joining_the_workers_fail_at_once(tmp_path):
    """The red case: it must fail, within the timeout.

    Without joining once Keras is imported, the model's variables start
    TensorFlow before `compile` asks for the strategy, which the executor
    can no longer make: each worker fails with a message saying why.
    """
    done = start_two(tmp_path, "srun", "tensorflow", 3, joined=False, **VARIABLES)
    assert done.returncode != 0
    assert "Cannot start TensorFlow across processes" in done.stderr, done.stderr[
        -4000:
    ]
    assert not os.listdir(tmp_path)  # No worker trained.


SLURM = SLURM_TASK_1_OF_2_NODES


def test_tf_config_is_filled_from_the_launcher_where_unset():
    environ = dict(SLURM)
    assert workers.wanted(environ)
    assert workers.fill_tf_config(environ) == ["TF_CONFIG"]
    assert json.loads(environ["TF_CONFIG"]) == {
        "cluster": {"worker": ["node01:18457", "node02:18457"]},
        "task": {"type": "worker", "index": 1},
    }
    assert workers.cluster_workers(environ) == (["node01:18457", "node02:18457"], 1)
    assert workers.fill_tf_config(environ) == []  # Set now: kept.


def test_a_tf_config_of_ones_own_wins():
    own = json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}})
    environ = dict(SLURM, TF_CONFIG=own)
    assert workers.fill_tf_config(environ) == []
    assert environ["TF_CONFIG"] == own
    assert not workers.wanted(environ)  # One worker, as the user said.


def test_one_process_or_a_bare_machine_sets_nothing():
    alone = dict(SLURM, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")
    alone["SLURM_STEP_TASKS_PER_NODE"] = "1"
    for environ in ({}, alone):
        assert workers.fill_tf_config(environ) == []
        assert "TF_CONFIG" not in environ
        assert not workers.wanted(environ)


#: `python -c IMPORT_KERAS OUT UNSUPPORTED`: imports keras_parallel, then
#: Keras; prints whether that imported the backend's modules, or its error.
#: With UNSUPPORTED=1, every module of keras_parallel's TensorFlow backend
#: fails to import as on a Keras whose internals it does not know.
IMPORT_KERAS = r"""
import importlib.abc, json, os, sys

from keras_parallel.errors import UnsupportedKerasError


class Unsupported(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("keras_parallel.backends.tensorflow"):
            raise UnsupportedKerasError("Keras 9.9 lacks keras.src.x (simulated)")


if sys.argv[2] == "1":
    sys.meta_path.insert(0, Unsupported())
import keras_parallel

try:
    import keras
except Exception as error:
    found = {"error": type(error).__name__, "message": str(error)}
    found["cause"] = type(error.__cause__).__name__
else:
    found = {"error": None}
found["backend_modules"] = sorted(
    name for name in sys.modules if name.startswith("keras_parallel.backends")
)
os.write(1, (json.dumps(found) + "\n").encode())
"""


def import_keras(tmp_path, unsupported=False, **variables):
    env = bare_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", **variables)
    command = [sys.executable, "-c", IMPORT_KERAS, str(tmp_path)]
    try:
        done = run_in_session([*command, "1" if unsupported else "0"], env, 120)
    finally:
        assert not gone(str(tmp_path)), "a process outlived the test"
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(300)
def test_without_a_cluster_no_backend_module_is_imported(tmp_path):
    """Not even on a Keras whose internals keras_parallel does not know."""
    for unsupported in (False, True):
        found = import_keras(tmp_path, unsupported)
        assert found == {"error": None, "backend_modules": []}


@pytest.mark.timeout(180)
def test_with_a_cluster_an_unsupported_keras_fails_the_join(tmp_path):
    found = import_keras(tmp_path, unsupported=True, **SLURM)
    assert found["error"] == "ClusterJoinError"
    assert found["cause"] == "UnsupportedKerasError"
    assert "Keras 9.9 lacks keras.src.x" in found["message"]
    assert "KERAS_PARALLEL_CLUSTER=off" in found["message"]


@pytest.mark.timeout(180)
def test_a_tf_config_of_a_parameter_server_cluster_is_refused(tmp_path):
    config = {
        "cluster": {"ps": ["a:1"], "worker": ["b:1", "c:1"]},
        "task": {"type": "ps", "index": 0},
    }
    found = import_keras(tmp_path, TF_CONFIG=json.dumps(config))
    assert found["error"] == "ClusterJoinError"
    assert found["cause"] == "ClusterEnvironmentError"
    message = found["message"]
    assert "TF_CONFIG names a 'ps' task" in message
    assert 'only clusters of "worker" tasks' in message
    assert found["backend_modules"] == []  # Refused before any was imported.


@pytest.mark.timeout(180)
def test_a_worker_that_raises_is_named_and_both_end(tmp_path):
    """Rank 1 raises after the join while rank 0 waits for it in a sum.

    Each worker prints its error under its rank (keras_parallel's
    excepthook) and both end within seconds: TensorFlow has no shutdown
    barrier to wait at, and rank 0's sum fails once rank 1 is gone.
    """
    started = time.monotonic()
    done = start_two(
        tmp_path,
        "srun",
        "tensorflow",
        3,
        script="tensorflow_join_script.py",
        args=(1,),
        timeout=90,
        **VARIABLES,
    )
    assert time.monotonic() - started < 60
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert sorted(line["rank"] for line in lines) == [0, 1], done.stderr[-3000:]
    assert all(line["replicas"] == 4.0 for line in lines)  # 2 workers x 2.
    assert all(code != 0 for code in exit_codes(done))
    assert "keras_parallel: rank 1 of 2 raised the error below" in done.stderr
    assert "RuntimeError: rank 1 raises after the join" in done.stderr
    assert "keras_parallel: rank 0 of 2 raised the error below" in done.stderr
