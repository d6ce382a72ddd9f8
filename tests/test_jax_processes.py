"""Several JAX processes: `keras-parallel launch --backend jax`, as a user runs it.

2 processes x 4 simulated CPU devices form one 8-device mesh over
`jax.distributed` (gloo). Every process runs `tests/jax_processes_script.py`
unchanged; the weights must equal the one-process 8-device run and
single-device training, agree on every process, and each process must have
fed only its own rows. Each launch has a hard timeout and its own session,
killed whole if it runs over; no process may be left.
"""

import os
import time

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX processes (tox -e jax)"
)

from cluster_launchers import max_rel, results  # noqa: E402
from subprocesses import (  # noqa: E402
    checkout_env,
    jax_launch_command,
    run_in_session,
    running,
)  # noqa: E402

if keras.backend.backend() == "jax":
    import jax_processes_script as script

EQUIVALENCE_CASES = (
    "data_parallel_one_step",
    "data_parallel_epoch",
    "model_parallel_one_step",
    "model_parallel_epoch",
    "model_parallel_across_one_step",
)
TIMEOUT_S = 240


def launch(out, case, *options):
    command = jax_launch_command("jax_processes_script.py", out, case, options=options)
    return run_in_session(command, checkout_env(KERAS_BACKEND="jax"), TIMEOUT_S)


def reference(case, distributed):
    model = script.build(case, seed=1, distributed=distributed)
    script.train(model, case)
    return [np.asarray(v.value) for v in model.weights]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every equivalence case, in one launch (`case_batches`)."""
    from case_batches import run_batch

    def launch_cases(cases, out):
        result = launch(out, ",".join(cases))
        return result.stdout[-2000:] + result.stderr

    out = tmp_path_factory.mktemp("equivalence")
    outcomes = run_batch(EQUIVALENCE_CASES, launch_cases, out, processes=2)
    return outcomes  # `.check()`: its folder, or the test fails naming it.


@pytest.mark.parametrize("case", EQUIVALENCE_CASES)
def test_weights_equal_one_process_and_one_device(launched, case):
    weights, _ = results(launched[case].check())
    for a, b in zip(weights[0], weights[1], strict=True):
        np.testing.assert_array_equal(a, b)  # Every process: one model.
    tolerance = 1e-5 if case.endswith("one_step") else 1e-4
    assert max_rel(weights[0], reference(case, distributed=True)) < tolerance
    assert max_rel(weights[0], reference(case, distributed=False)) < tolerance
    initial = [np.asarray(v.value) for v in script.build(case, seed=1).weights]
    assert max_rel(weights[0], initial) > 1e-3  # Training did something.


@pytest.mark.parametrize("case", ["data_parallel_epoch", "model_parallel_epoch"])
def test_each_process_feeds_only_its_rows(launched, case):
    _, infos = results(launched[case].check())
    assert infos[0]["rows"] == list(range(32))
    assert infos[1]["rows"] == list(range(32, 64))
    assert infos[0]["loss"] == infos[1]["loss"]


@pytest.mark.parametrize("case", ["data_parallel_epoch", "model_parallel_epoch"])
def test_predict_and_evaluate_are_whole_on_every_process(launched, case):
    _, infos = results(launched[case].check())
    directory = launched[case].check()
    model = script.build(case, seed=1, distributed=True)
    script.train(model, case)
    x, y = script.data()
    expected = model.predict(x[:203], batch_size=64, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    for process in (0, 1):
        predictions = np.load(os.path.join(directory, f"predictions{process}.npy"))
        assert predictions.shape == (203, 8)  # In input order, uneven tail.
        np.testing.assert_allclose(predictions, expected, atol=1e-5)
        assert set(infos[process]["evaluation"]) == set(evaluation)
        for key, value in evaluation.items():
            assert infos[process]["evaluation"][key] == pytest.approx(value, rel=1e-5)


def test_describe_shows_the_global_mesh(launched):
    _, infos = results(launched["data_parallel_epoch"].check())
    for info in infos:
        assert info["devices"] == 8 and info["local_devices"] == 4
        assert "Backend: jax, 8 devices in 2 processes" in info["describe"]
        assert "Mesh: batch=8 (8 devices" in info["describe"]
        held = {
            line.split(":", 1)[0]: line.split(":", 1)[1].split(",")
            for line in info["describe"].splitlines()
            if line.startswith("Process ")
        }
        assert sorted(held) == ["Process 0", "Process 1"]
        assert len(held["Process 0"]) == len(held["Process 1"]) == 4
        assert not set(held["Process 0"]) & set(held["Process 1"])


@pytest.mark.parametrize("case", EQUIVALENCE_CASES)
def test_saved_files_load_on_one_device(launched, case):
    """`model.save` and `ModelCheckpoint`, whole, written once by process 0."""
    weights, _ = results(launched[case].check())
    directory = launched[case].check()
    assert sorted(
        f for f in os.listdir(directory) if not f.endswith((".npz", ".npy", ".json"))
    ) == [
        "checkpoint.weights.h5",
        "model.keras",
    ]
    loaded = keras.saving.load_model(os.path.join(directory, "model.keras"))
    assert type(loaded).__name__ == "Functional"  # Plain Keras, one device.
    for a, b in zip(loaded.get_weights(), weights[0], strict=True):
        np.testing.assert_array_equal(a, b)
    restored = script.build(case, seed=7, distributed=False)
    restored.load_weights(os.path.join(directory, "checkpoint.weights.h5"))
    for a, b in zip(restored.get_weights(), weights[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", EQUIVALENCE_CASES)
def test_what_process_0_wrote_is_there_for_every_process_when_the_call_returns(
    launched, case
):
    # Process 0's writes land half a second late (a slow file system):
    # `fit` with a `ModelCheckpoint`, and `model.save`, return on process 1
    # only once they are in place; `load_model` right after `save` reads
    # the weights saved, on every process.
    _, infos = results(launched[case].check())
    assert [info["checkpoint_there_after_fit"] for info in infos] == [True, True]
    assert [info["loaded_as_saved"] for info in infos] == [True, True]


def test_model_axis_across_processes_splits_the_kernel_between_them(launched):
    _, infos = results(launched["model_parallel_across_one_step"].check())
    for info in infos:
        # d1/kernel (16, 32) split 2 ways over `model`, which spans the
        # processes: each process holds one half on each of its 4 devices.
        assert info["kernel_shards"] == [[16, 16]] * 4


def test_model_parallel_splits_the_kernel_within_each_process(launched):
    _, infos = results(launched["model_parallel_epoch"].check())
    for info in infos:
        # d1/kernel (16, 32) split 4 ways over `model`, on 4 local devices.
        assert info["kernel_shards"] == [[16, 8]] * 4
        # The d2/output constraint is in the compiled step of every process:
        # d2's (64, 8) output split by rows over "data" (Shardy's notation).
        assert any(
            '[{"data"}, {}]' in line and "tensor<64x8xf32>" in line
            for line in info["sharding_ops"]
        ), info["sharding_ops"]
        assert "d1/kernel" in info["describe"] and "(-, model)" in info["describe"]


def test_a_process_that_raises_ends_every_process(tmp_path):
    result = launch(tmp_path, "fail")
    # From the raise to the launch's end: the launcher's grace for the
    # others (5 s) and its SIGTERM-to-SIGKILL grace (5 s), not a collective's
    # timeout (300 s); the start-up before it is the machine's.
    elapsed = time.time() - float((tmp_path / "raised_at").read_text())
    assert result.returncode == 1, result.stderr[-3000:]
    assert "ValueError: boom on process 1" in result.stderr
    assert "process 1 failed with exit code 1" in result.stderr
    assert elapsed < 40, elapsed
    assert running(str(tmp_path)) == []


def test_processes_given_different_distributions_all_stop(tmp_path):
    start = time.monotonic()
    result = launch(tmp_path, "disagree")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "The processes were given different distributions" in result.stderr
    assert "processes [1] differ from process 0" in result.stderr
    assert time.monotonic() - start < 60
    assert running(str(tmp_path)) == []


def test_a_taken_coordinator_port_is_named(tmp_path):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = launch(tmp_path, "data_parallel_one_step", "--master-port", port)
    assert result.returncode == 2
    assert "the coordinator port is taken" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be a positive number"),
        (["--nnodes", "2"], "several nodes need one coordinator port"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in [0, 2)"),
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
        # TEST-NET-1 (RFC 5737): an address no machine here has.
        (["--master-addr", "192.0.2.1"], "--master-addr is not an address of"),
    ],
)
def test_bad_launch_options_name_the_fix(tmp_path, options, message):
    result = launch(tmp_path, "data_parallel_one_step", *options)
    assert result.returncode == 2
    assert message in result.stderr
    assert not list(tmp_path.iterdir())  # Nothing ran, nothing written.


def test_a_single_machine_launch_listens_on_loopback_only(tmp_path):
    # JAX's coordination service binds every interface unless told where;
    # the launch tells it the address its processes reach it at.
    from listening_sockets import assert_loopback_only, sockets_while_in_fit

    command = jax_launch_command("listening_script.py", tmp_path)
    env = checkout_env(KERAS_BACKEND="jax", KP_WAIT_S="3")
    assert_loopback_only(*sockets_while_in_fit(command, env, tmp_path, 2, TIMEOUT_S))
