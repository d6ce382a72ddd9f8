"""Several TensorFlow workers: `keras-parallel launch --backend tensorflow`.

2 workers x 2 logical CPU devices form one 4-replica
`MultiWorkerMirroredStrategy`. Every worker runs
`tests/tensorflow_processes_script.py` unchanged; the weights must equal
single-device training over the same global batches, agree on every worker,
and each worker must have computed only its rows of each global batch (its
model's first layer records them). Each launch has a hard timeout and its
own session, killed whole if it runs over; no process may be left.
"""

import json
import os
import socket
import sys
import time

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow workers (tox -e tensorflow)",
)

from cluster_launchers import max_rel  # noqa: E402
from subprocesses import checkout_env, run_in_session, running  # noqa: E402

if keras.backend.backend() == "tensorflow":
    import tensorflow_processes_script as script

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 240
CASES = ("one_step", "epoch")


def launch(out, case, *options):
    command = [
        sys.executable,
        "-m",
        "keras_parallel.cli",
        "launch",
        "--backend",
        "tensorflow",
        "--nproc-per-node",
        "2",
        "--allow-reachable-workers",
        "--devices-per-process",
        "2",
        *options,
        os.path.join(HERE, "tensorflow_processes_script.py"),
        str(out),
        case,
    ]
    env = checkout_env(KERAS_BACKEND="tensorflow")
    # As from a user's shell, where tox's TF_CPP_MIN_LOG_LEVEL is not set:
    # the workers' own logging is under test too.
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return run_in_session(command, env, TIMEOUT_S)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch: both cases, each on a fresh model, on both workers."""
    directory = tmp_path_factory.mktemp("train")
    result = launch(directory, "train")
    assert result.returncode == 0, result.stderr[-4000:]
    infos = []
    for worker in (0, 1):
        with open(os.path.join(directory, f"info{worker}.json")) as f:
            infos.append(json.load(f))
    return str(directory), infos, result


def weights(directory, case, worker):
    with np.load(os.path.join(directory, f"{case}_weights{worker}.npz")) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k[4:]))]


def global_batches(infos, case):
    """Each step's global batch: the rows of every worker, together."""
    steps = [info[case]["rows"] for info in infos]
    assert len(steps[0]) == len(steps[1])
    return [sorted(a + b) for a, b in zip(*steps, strict=True)]


@pytest.fixture(scope="module")
def one_device():
    """Each case trained on one device from the data, not from the run.

    `{case: (model, rows of each global batch)}`. The one step takes the
    first 64 rows; the shuffled epoch takes them in the order the workers
    must draw: worker 0's NumPy permutation (`build` seeds NumPy with
    `keras.utils.set_random_seed(1)`; across workers Keras's shuffle is
    NumPy's, `workers.numpy_shuffles`), the first one drawn, as on one
    device: the model is built from the data set's element spec, which
    opens no iterator (Keras's own build under a strategy draws a first
    batch, and a permutation with it). Nothing the workers reported goes
    in, so rows they skipped, computed twice or ordered otherwise show.
    """
    x, y = script.data()
    out = {}
    for case in CASES:
        model = script.build(seed=1, distributed=False)  # Worker 0's seed.
        if case == "one_step":
            order = np.arange(64)
        else:
            order = epoch_order(len(x))
        model.fit(x[order], y[order], batch_size=64, shuffle=False, verbose=0)
        batches = [order[i : i + 64].tolist() for i in range(0, len(order), 64)]
        out[case] = model, batches
    return out


def epoch_order(rows):
    """The order of the workers' shuffled first epoch.

    Keras 3.15 shuffles with `tf.random.shuffle`, which across workers is
    drawn from NumPy (`workers.numpy_shuffles`): worker 0's permutation.
    Keras 3.16 shuffles statelessly, seeded by the epoch, the same on every
    worker and on one device: read from its own adapter.
    """
    from keras_parallel.backends.tensorflow.keras_compat import ArrayDataAdapter

    if not hasattr(ArrayDataAdapter, "_tf_shuffle"):  # Keras 3.15
        return np.random.RandomState(1).permutation(rows)
    adapter = ArrayDataAdapter(np.arange(rows), shuffle=True, batch_size=64)
    batches = adapter.get_tf_dataset()  # Of `x` alone: each a tensor.
    return np.concatenate([np.asarray(batch) for batch in batches])


@pytest.mark.parametrize("case", CASES)
def test_weights_equal_one_device_on_every_worker(launched, one_device, case):
    directory, _, _ = launched
    first, second = weights(directory, case, 0), weights(directory, case, 1)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)  # Every worker: one model.
    reference, _ = one_device[case]
    tolerance = 1e-5 if case == "one_step" else 1e-4
    assert max_rel(first, reference.get_weights()) < tolerance
    initial = script.build(seed=1, distributed=False).get_weights()
    assert max_rel(first, initial) > 1e-3  # Training did something.


@pytest.mark.parametrize("case", CASES)
def test_each_worker_computes_only_its_rows(launched, one_device, case):
    _, infos, _ = launched
    rows = [info[case]["rows"] for info in infos]
    batches = global_batches(infos, case)
    # The workers' global batches are one device's, step by step.
    assert batches == [sorted(b) for b in one_device[case][1]]
    if case == "one_step":
        assert batches == [list(range(64))]
    else:
        sizes = [len(b) for b in batches]
        assert sizes == [64] * 15 + [43]  # The uneven last batch.
        everything = np.concatenate(batches)
        assert sorted(everything) == list(range(1003))  # Each sample once.
        assert list(everything) != list(range(1003))  # Shuffled.
    for mine, theirs in zip(*rows, strict=True):
        assert not set(mine) & set(theirs)  # A split, not all rows each.
        assert abs(len(mine) - len(theirs)) <= 1
    assert infos[0][case]["loss"] == infos[1][case]["loss"]


def test_predict_and_evaluate_are_whole_on_every_worker(launched, one_device):
    directory, infos, _ = launched
    model, _ = one_device["epoch"]
    x, y = script.data()
    expected = model.predict(x[:203], batch_size=64, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    for worker in (0, 1):
        predictions = np.load(os.path.join(directory, f"epoch_predictions{worker}.npy"))
        assert predictions.shape == (203, 8)  # In input order, uneven tail.
        np.testing.assert_allclose(predictions, expected, atol=1e-4)
        assert set(infos[worker]["epoch"]["evaluation"]) == set(evaluation)
        for key, value in evaluation.items():
            got = infos[worker]["epoch"]["evaluation"][key]
            assert got == pytest.approx(value, rel=1e-4)


def test_describe_shows_every_worker_and_its_devices(launched):
    _, infos, _ = launched
    for info in infos:
        assert info["devices"] == 4 and info["local_devices"] == 2
        text = info["epoch"]["describe"]
        assert "Backend: tensorflow, 4 devices in 2 processes" in text
        assert "Mesh: batch=4 (4 devices" in text
        assert "Process 0: worker0/cpu:0, worker0/cpu:1" in text
        assert "Process 1: worker1/cpu:0, worker1/cpu:1" in text


def test_worker_0_alone_prints_and_writes_files(launched):
    directory, _, result = launched
    stdout = result.stdout
    written = sorted(f for f in os.listdir(directory) if not f.startswith("info"))
    names = ("log0.csv", "model0.keras", "predictions0.npy", "predictions1.npy")
    names += ("weights0.npz", "weights1.npz", "checkpoint.weights.h5", "model.keras")
    assert written == sorted(f"{case}_{name}" for case in CASES for name in names)
    # One progress line per fit (verbose=2 prints one per epoch).
    assert stdout.count("1/1 - ") == 1 and stdout.count("16/16 - ") == 1, stdout
    # The workers do not divide the input yet, and worker 0 says so, once.
    line = "Input: arrays, read whole by each of 2 processes, each keeping its rows"
    assert stdout.count(line) == 1, stdout


@pytest.mark.parametrize("case", CASES)
def test_what_worker_0_wrote_is_there_for_every_worker_when_the_call_returns(
    launched, case
):
    # Worker 0's writes land half a second late (a slow file system): `fit`
    # with a `ModelCheckpoint`, and `model.save`, return on worker 1 only
    # once they are in place; `load_model` right after `save` reads the
    # weights saved, on every worker.
    _, infos, _ = launched
    assert [info[case]["checkpoint_there_after_fit"] for info in infos] == [True] * 2
    assert [info[case]["loaded_as_saved"] for info in infos] == [True, True]


def test_tensorflow_start_up_info_lines_are_quiet(launched):
    # TensorFlow's INFO lines as its servers start, among them a bare
    # "/job:worker/replica:0/task:1" (the straggler list of a multi-line
    # message), hidden by the bootstrap; warnings and errors are not.
    stderr = launched[2].stderr
    assert "/job:worker/" not in stderr, stderr[-3000:]
    assert "coordination_service" not in stderr, stderr[-3000:]


def test_a_launch_of_workers_says_once_that_they_are_reachable(launched):
    # TensorFlow's gRPC server cannot be bound to loopback (docs/multihost.md).
    from keras_parallel.launcher.tf_processes import LISTENS_WIDELY

    assert launched[2].stderr.count(LISTENS_WIDELY) == 1, launched[2].stderr[-3000:]


def test_one_process_on_one_machine_listens_on_nothing(tmp_path):
    # The launch's default on one machine: one process, no TF_CONFIG, so no
    # gRPC server; DataParallel over its 2 CPU devices (MirroredStrategy).
    from listening_sockets import sockets_while_in_fit

    command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
    command += ["--backend", "tensorflow", "--devices-per-process", "2"]
    command += [os.path.join(HERE, "listening_script.py"), str(tmp_path)]
    env = checkout_env(KERAS_BACKEND="tensorflow", KP_WAIT_S="1")
    sockets, result = sockets_while_in_fit(command, env, tmp_path, 1, 240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sockets == [], f"one process listened: {sockets}"
    from keras_parallel.launcher.tf_processes import LISTENS_WIDELY

    assert LISTENS_WIDELY not in result.stderr


def test_several_workers_on_one_machine_are_an_explicit_choice(tmp_path):
    # Without --allow-reachable-workers, refused before anything starts.
    command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
    command += ["--backend", "tensorflow", "--nproc-per-node", "2"]
    command += [os.path.join(HERE, "listening_script.py"), str(tmp_path)]
    result = run_in_session(command, checkout_env(KERAS_BACKEND="tensorflow"), 60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "anyone who can connect can run code in these processes" in result.stderr
    assert "--allow-reachable-workers" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # Nothing ran.


def test_clipping_accumulation_and_steps_per_execution_across_workers(tmp_path):
    # The gradients summed over every replica of every worker before they
    # are clipped and accumulated, and a step run in Keras's `tf.cond` (4
    # steps per execution): collectives keyed when traced agree across
    # workers.
    result = launch(tmp_path, "features")
    assert result.returncode == 0, result.stderr[-4000:]
    x, y = script.data()
    reference = script.build(seed=1, distributed=False, features=True)
    expected = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    infos = []
    for worker in (0, 1):
        with open(os.path.join(tmp_path, f"info{worker}.json")) as f:
            infos.append(json.load(f))
        mine = weights(tmp_path, "features", worker)
        assert max_rel(mine, reference.get_weights()) < 1e-4
        assert infos[worker]["loss"] == pytest.approx(
            expected.history["loss"], rel=1e-5
        )
    # 4 replicas: at most 16 rows of a global batch of 64 each, every
    # sample once per epoch over the workers.
    rows = infos[0]["rows"] + infos[1]["rows"]
    assert max(rows) == 16
    assert sum(rows) == 2 * len(x)


def test_a_worker_that_raises_ends_every_worker(tmp_path):
    start = time.monotonic()
    result = launch(tmp_path, "fail")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    assert "ValueError: boom on worker 1" in result.stderr
    assert "worker 1 failed with exit code 1" in result.stderr
    assert elapsed < 60, elapsed
    assert running(str(tmp_path)) == []


def test_a_taken_port_is_named(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        # Worker 1 would listen on port + 1: worker 0's port is taken.
        result = launch(tmp_path, "train", "--master-port", str(port))
    assert result.returncode == 2
    assert "the worker 0 port is taken" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be a positive number"),
        (["--nnodes", "2"], "several TensorFlow nodes need every node's address"),
        (
            ["--nnodes", "2", "--node-addrs", "127.0.0.1,127.0.0.1"],
            "several TensorFlow nodes need one base port",
        ),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in [0, 2)"),
        (["--node-addrs", "a,b"], "--node-addrs must list one address per node"),
    ],
)
def test_bad_launch_options_name_the_fix(tmp_path, options, message):
    result = launch(tmp_path, "train", *options)
    assert result.returncode == 2
    assert message in result.stderr
    assert not list(tmp_path.iterdir())  # Nothing ran, nothing written.


def test_a_missing_script_is_named(tmp_path):
    command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
    command += ["--backend", "tensorflow", "--nproc-per-node", "2", "no_such.py"]
    result = run_in_session(command, checkout_env(), 60)
    assert result.returncode == 2
    assert "the script 'no_such.py' does not exist" in result.stderr


def test_worker_addresses_follow_the_node_rule():
    from keras_parallel.launcher import local_processes, tf_processes

    argv = "--nnodes 2 --node-rank 1 --nproc-per-node 2 --master-port 4000 "
    argv += f"--node-addrs 10.0.0.1,10.0.0.2 {__file__}"
    args = local_processes.parse(tf_processes._parser(), argv.split())
    addresses = tf_processes.node_addresses(args)
    workers = tf_processes.worker_addresses(args, addresses)
    assert workers == [
        "10.0.0.1:4000",
        "10.0.0.1:4001",
        "10.0.0.2:4002",
        "10.0.0.2:4003",
    ]
    commands = tf_processes.commands(args, workers, base_env={})
    tasks = [json.loads(env["TF_CONFIG"])["task"]["index"] for _, env in commands]
    assert tasks == [2, 3]
    assert all(
        json.loads(env["TF_CONFIG"])["cluster"]["worker"] == workers
        for _, env in commands
    )


def test_tf_config_is_read_and_a_bad_one_named():
    from keras_parallel.backends.tensorflow import workers

    config = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"index": 1}}
    assert workers.cluster_workers({"TF_CONFIG": json.dumps(config)}) == (
        ["a:1", "b:2"],
        1,
    )
    assert workers.cluster_workers({}) == ([], 0)
    with pytest.raises(ValueError, match="TF_CONFIG is not a cluster description"):
        workers.cluster_workers({"TF_CONFIG": "{not json"})
    assert workers.worker_of("worker1/cpu:0") == 1
    assert workers.worker_of("cpu:3") == 0
