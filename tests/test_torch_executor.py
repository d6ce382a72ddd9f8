"""The torch executor: DDP under plain `model.fit`, proved by equivalence.

Multi-process tests start gloo processes on 127.0.0.1 with
`keras_parallel.launch` (a free port each, a hard `timeout`, every
child ended afterwards) and compare with single-process Keras on the same
global batches, SGD and no dropout. Several trainings share one launch to
keep the suite fast on a small machine.
"""

import time

import keras
import numpy as np
import pytest
import split_probe

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch executor tests"
)

torch = pytest.importorskip("torch") if keras.backend.backend() == "torch" else None

import torch_workers as workers  # noqa: E402

import keras_parallel  # noqa: E402
from keras_parallel.errors import ShardingError  # noqa: E402

LAUNCH_TIMEOUT = 240


def _launch(fn, n, args=(), **kwargs):
    from torch_launch import launch

    kwargs.setdefault("timeout", LAUNCH_TIMEOUT)
    kwargs.setdefault("collective_timeout", 60)
    return launch(fn, n, args=args, **kwargs)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def max_rel(weights, reference):
    assert weights, "no weights to compare"
    assert len(weights) == len(reference), (len(weights), len(reference))
    return max(rel(a, b) for a, b in zip(weights, reference, strict=True))


CASES = {
    "one_step": dict(steps=1),
    "ten_steps": dict(steps=10),
    "uneven_epoch": dict(steps=None, n=1003, with_validation=True),
    "callback_ten_steps": dict(door="callback", steps=10),
    "two_epochs_shuffled": dict(epochs=2, shuffle=True),
    "bn_sync_one_step": dict(steps=1, batchnorm=True, sync_batchnorm=True),
    "dataloader": dict(data_kind="dataloader", steps=None),
    "pydataset": dict(data_kind="pydataset", steps=None),
    "tf_data": dict(data_kind="tf_data", steps=None),
    "step_logs": dict(steps=None, record_step_logs=True),
    "callback_step_logs": dict(door="callback", steps=None, record_step_logs=True),
    "plateau": dict(
        epochs=12, n=256, with_validation=True, decide_on_plateau=True, shuffle=True
    ),
    # Every rank builds other initial weights: DDP's broadcast of rank 0's
    # must make them one model (the other cases seed every rank alike).
    "ranks_seeded_apart": dict(steps=10, seed_by_rank=True),
    # BatchNorm without sync_batchnorm: each rank's moving statistics come
    # from its own rows; rank 0's are given to all when fit ends.
    "bn_local": dict(steps=3, batchnorm=True),
}
# Compared across ranks only: per-rank batch statistics are not one device's.
RANKS_ONLY = {"bn_local"}
TOLERANCE = {
    "one_step": 1e-5,
    "bn_sync_one_step": 1e-5,
}


@pytest.fixture(scope="module")
def two_ranks():
    names = list(CASES)
    results = _launch(workers.scenarios, 2, args=([CASES[k] for k in names],))
    return {name: [rank[i] for rank in results] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def single():
    out = {}
    for name, case in CASES.items():
        case = dict(case, distributed=False, door="mixin")
        case.pop("sync_batchnorm", None)
        out[name] = workers.train(**case)
    return out


# ------------------------------------------------------------ one process
def test_executor_class_is_torch_executor():
    from keras_parallel.backends import executor_class
    from keras_parallel.backends.torch.executor import TorchExecutor

    assert executor_class("torch") is TorchExecutor


def test_data_parallel_without_group_spans_one_device():
    distribution = keras_parallel.DataParallel()
    assert distribution.device_mesh.devices.tolist() == ["cpu:0"]


def test_collectives_are_noops_in_one_process():
    from keras_parallel.backends.torch.executor import TorchExecutor

    executor = TorchExecutor(keras_parallel.DataParallel())
    assert executor.num_processes == 1 and executor.process_index == 0
    assert executor.is_chief
    assert executor.reduce(3.0) == 3.0
    assert executor.broadcast("x") == "x"
    executor.barrier()


def test_single_process_fit_is_plain_keras(capsys):
    plain = workers.train(distributed=False, steps=3)
    ours = workers.train(distributed=True, steps=3)
    assert "one device" in capsys.readouterr().out
    for a, b in zip(ours["weights"], plain["weights"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_model_parallel_that_splits_only_the_batch_runs_as_data_parallel():
    # A mesh that splits nothing but the batch needs no DTensor: DDP runs it.
    # ModelParallel proper: tests/test_torch_model_parallel.py.
    mesh = keras.distribution.DeviceMesh((1,), ["model"], ["cpu:0"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="model"
    )
    callback = keras_parallel.ShardingCallback(distribution)
    assert callback.binding.executor._mesh_runner is None


def test_mesh_larger_than_process_group_is_refused():
    distribution = keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
    with pytest.raises(ShardingError, match="one device per process.*torchrun"):
        keras_parallel.ShardingCallback(distribution)


def test_split_rows_covers_every_row_once():
    from keras_parallel.backends.torch.batches import split_rows

    assert split_rows(43, 2, 0) == (0, 22, False)
    assert split_rows(43, 2, 1) == (22, 43, False)
    for rows in (1, 3, 43, 64):
        for world in (2, 4):
            ranges = [split_rows(rows, world, r) for r in range(world)]
            if rows < world:
                assert all(whole for *_, whole in ranges)
                continue
            covered = [i for start, stop, _ in ranges for i in range(start, stop)]
            assert covered == list(range(rows))


def test_data_size_is_what_an_epoch_iterates_and_unknown_stays_unknown():
    from keras_parallel.backends.torch.batches import check_same_data, data_size
    from keras_parallel.backends.torch.keras_compat import TorchEpochIterator

    def size(x, **kwargs):
        return data_size(TorchEpochIterator(x=x, **kwargs))

    x = np.zeros((1003, 6), "float32")
    assert size(x, batch_size=64) == [1003, 16, 64, 43]
    assert size(x, batch_size=64, steps_per_epoch=5) == [1003, 5, 64, 43]
    assert size(np.zeros((1024, 6)), batch_size=64) == [1024, 16, 64, 64]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(1003, 6)), batch_size=64
    )
    assert size(loader) == [-1, 16, 64, 43]  # Rows unknown: drop_last may cut.

    def batches():
        yield (x[:64],)

    assert size(batches()) == [-1, -1, -1, -1]
    check_same_data([[1003, 16, 64, 43]] * 3)
    with pytest.raises(ValueError, match="data of different sizes") as raised:
        check_same_data([[1003, 16, 64, 43], [-1, -1, -1, -1]])
    assert "rank 0: 1003 rows, 16 steps of batch_size 64 (the last 43 rows)" in str(
        raised.value
    )
    assert "rank 1: rows unknown, steps unknown;" in str(raised.value)


# ---------------------------------------------------------- two processes
@pytest.mark.parametrize("name", list(CASES))
def test_weights_equal_single_process(two_ranks, single, name):
    ranks = two_ranks[name]
    reference = single[name]["weights"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)  # Bit-identical across ranks.
    for rank in ranks:  # Each rank computed its half of every batch.
        split_probe.assert_divided(rank["split"], 64, 2)
    if name not in RANKS_ONLY:
        assert max_rel(ranks[0]["weights"], reference) < TOLERANCE.get(name, 1e-4)


def test_local_batchnorm_statistics_were_trained(two_ranks, single):
    # The agreement above means something only if the statistics moved.
    initial = workers.weights_of(workers.make_model(distributed=False, batchnorm=True))
    moved = [
        rel(a, b)
        for a, b in zip(two_ranks["bn_local"][0]["weights"], initial, strict=True)
    ]
    assert max(moved) > 1e-3


# Keras's global seed generator (`RankRandomStream`), and a layer's own
# seed generator, a variable every rank builds alike (offset by rank).
@pytest.mark.parametrize("seed", [None, 7])
def test_each_rank_draws_its_own_dropout_mask(seed):
    # As the slices of one global batch would: rank 1's rows are not masked
    # like rank 0's (they would be if the rank were not in the seed).
    masks = _launch(workers.dropout_masks, 2, args=(seed,))
    assert masks[0].shape == masks[1].shape == (32, 16)
    assert 0 < masks[0].mean() < 1
    assert not np.array_equal(masks[0], masks[1])


def test_the_model_runs_the_trainers_methods_while_fit_runs(two_ranks):
    # fit, evaluate and predict run the model with `TorchTrainer`'s methods
    # put on it, its class its own throughout (`type(model) is
    # model.__class__`); taken off after each. For the model's distributed
    # life rank 1 writes no file and waits for rank 0's (`ChiefOnlySaving`),
    # and rank 0 tells it when its file is written (`ChiefSaving`); a
    # `ShardingCallback` run writes whole files (`AtomicSaving`).
    for name, ranks in two_ranks.items():
        callback = CASES[name].get("door") == "callback"
        own = "Functional" if callback else "Net"
        for rank in ranks:
            chief = ["ChiefOnlySaving"] if rank["rank"] else ["ChiefSaving"]
            atomic = ["AtomicSaving"] if callback else []
            during = [*atomic, "TorchTrainer", *chief]
            assert rank["class_during_fit"] == (own, True, during), name
            assert rank["class_after"] == (own, True, chief), name


def test_training_moved_the_weights(two_ranks, single):
    # Equality with single-process training means something only if training
    # did something: an ignored distribution must not pass by staying put.
    initial = workers.weights_of(workers.make_model(distributed=False))
    assert max_rel(two_ranks["uneven_epoch"][0]["weights"], initial) > 1e-2


@pytest.mark.parametrize(
    "name",
    ["uneven_epoch", "two_epochs_shuffled", "dataloader", "pydataset", "tf_data"],
)
def test_logs_equal_single_process(two_ranks, single, name):
    for result in two_ranks[name]:
        assert set(result["history"]) == set(single[name]["history"])
        assert set(result["evaluation"]) == set(single[name]["evaluation"])
        for key, values in single[name]["history"].items():
            np.testing.assert_allclose(result["history"][key], values, rtol=1e-5)
        for key, value in single[name]["evaluation"].items():
            np.testing.assert_allclose(result["evaluation"][key], value, rtol=1e-5)


@pytest.mark.parametrize("name", ["step_logs", "callback_step_logs"])
def test_step_logs_are_global_when_a_callback_reads_them(two_ranks, single, name):
    # Without such a callback, metrics are made global once per epoch (the
    # History checks above); with one, after every step.
    reference = single[name]["step_logs"]
    assert len(reference) == 16  # 1003 samples at batch 64.
    for result in two_ranks[name]:
        assert len(result["step_logs"]) == len(reference)
        for mine, theirs in zip(result["step_logs"], reference, strict=True):
            assert set(mine) == set(theirs)
            for key, value in theirs.items():
                assert mine[key] == pytest.approx(value, rel=1e-5), key


def test_early_stopping_and_lr_schedule_decide_as_one_process(two_ranks, single):
    # ReduceLROnPlateau and EarlyStopping read val_loss; the weights (checked
    # for every case above) equal one process's only if the LR was cut at
    # the same epochs, and the run stops at the same epoch on every rank.
    epochs = len(single["plateau"]["history"]["loss"])
    assert epochs < 12, "EarlyStopping never fired: the test proves nothing"
    for result in two_ranks["plateau"]:
        assert len(result["history"]["loss"]) == epochs


def test_predict_equals_single_process_in_input_order(two_ranks, single):
    reference = single["uneven_epoch"]["predictions"]
    for result in two_ranks["uneven_epoch"]:
        assert result["predictions"].shape == reference.shape == (203, 3)
        np.testing.assert_allclose(result["predictions"], reference, atol=1e-5)


def test_each_sample_seen_once_per_epoch_with_one_shuffle():
    n, batch, epochs = 1003, 64, 2
    seen = _launch(workers.count_samples, 2, args=(epochs, n, batch, True))
    steps = -(-n // batch)
    for rank_steps in seen:
        assert len(rank_steps) == steps * epochs
    orders = []
    for epoch in range(epochs):
        ids = []
        for step in range(epoch * steps, (epoch + 1) * steps):
            sizes = [len(r[step]) for r in seen]
            assert max(sizes) - min(sizes) <= 1  # 22/21 on the last batch.
            for r in seen:
                ids += r[step]
        assert sorted(ids) == list(range(n))
        orders.append(ids)
    assert orders[0] != orders[1]  # Shuffled, and differently per epoch.
    assert orders[0] != list(range(n))


def test_collectives_over_two_ranks():
    infos = _launch(workers.rank_info, 2)
    for rank, info in enumerate(infos):
        assert info["devices"] == ["cpu:0", "cpu:1"]
        assert info["rank"] == rank and info["world"] == 2
        assert info["sum"] == 3.0 and info["mean"] == 1.5
        assert info["broadcast"] == "from 0"


def test_failing_rank_is_named_and_run_ends_in_bounded_time():
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 1") as raised:
        _launch(workers.fail_at, 2, args=(3, 1), collective_timeout=30)
    assert time.monotonic() - start < 90
    assert raised.value.rank == 1
    peer = raised.value.rank_errors[0]
    assert "PeerFailedError" in peer and "Rank 1 failed" in peer


def test_rank_raising_in_a_callback_is_named_within_seconds():
    # Outside any step, in a model whose BatchNorm statistics are synced
    # when fit ends normally: the failing rank must not run that collective
    # while its error unwinds (it hung until the collective timeout).
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 1 at batch 3") as raised:
        _launch(
            workers.fail_at,
            2,
            args=(3, 1, "callback", True),
            collective_timeout=60,
        )
    assert time.monotonic() - start < 45
    assert raised.value.rank == 1
    peer = raised.value.rank_errors[0]
    assert "PeerFailedError" in peer and "Rank 1 failed" in peer
    assert "boom on rank 1" in peer


# --------------------------------------- a custom train_step, as the guide
# Keras's guide "Customizing what happens in fit() with PyTorch": the step
# returns `metric.result()` read from the rank's own metric state, and Keras
# keeps those logs (not `get_metrics_result()`) for the History, callbacks
# and `evaluate`. They held each rank's own numbers (the guide's data:
# one process 2.43265; rank 0 2.56601, rank 1 2.29929).
GUIDE_CASES = {
    # Per epoch: nothing reads step logs (verbose=0).
    "metrics": dict(variant="metrics"),
    "own_metrics": dict(variant="own_metrics"),
    # Per step: a callback reads every step's logs.
    "metrics_step_logs": dict(variant="metrics", record_step_logs=True),
    "own_metrics_step_logs": dict(variant="own_metrics", record_step_logs=True),
    # The step's own tensors, not metric results: the mean over ranks
    # weighted by their rows, exact for a batch's mean on the 22/21 split
    # of the last batch (1003 samples at batch 64).
    "tensors_uneven": dict(variant="tensors", n=1003),
    "tensors_uneven_step_logs": dict(variant="tensors", n=1003, record_step_logs=True),
    # Another distributed model evaluated inside this fit, at its step 2:
    # this fit's step logs stay global after it.
    "nested_distributed": dict(
        variant="metrics", record_step_logs=True, nested="distributed"
    ),
}


@pytest.fixture(scope="module")
def guide_two_ranks():
    names = list(GUIDE_CASES)
    results = _launch(
        workers.guide_scenarios, 2, args=([GUIDE_CASES[k] for k in names],)
    )
    return {name: [rank[i] for rank in results] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def guide_single():
    return {
        name: workers.guide_train(**dict(case, distributed=False))
        for name, case in GUIDE_CASES.items()
    }


def _assert_logs_equal(mine, theirs, what):
    assert set(mine) == set(theirs), what
    for key, values in theirs.items():
        np.testing.assert_allclose(
            mine[key], values, rtol=1e-5, err_msg=f"{what}: {key}"
        )


@pytest.mark.parametrize("name", list(GUIDE_CASES))
def test_custom_train_step_logs_equal_one_process_on_every_rank(
    guide_two_ranks, guide_single, name
):
    reference = guide_single[name]
    assert len(reference["history"]["loss"]) == 2
    # 512 or 1003 samples at batch 64, two epochs.
    steps = 16 if GUIDE_CASES[name].get("n", 512) == 512 else 32
    assert len(reference["step_logs"]) == (
        steps if GUIDE_CASES[name].get("record_step_logs") else 0
    )
    for rank, result in enumerate(guide_two_ranks[name]):
        _assert_logs_equal(result["history"], reference["history"], f"rank {rank}")
        _assert_logs_equal(
            result["evaluation"], reference["evaluation"], f"rank {rank} evaluate"
        )
        assert len(result["step_logs"]) == len(reference["step_logs"])
        for step, (mine, theirs) in enumerate(
            zip(result["step_logs"], reference["step_logs"], strict=True)
        ):
            _assert_logs_equal(mine, theirs, f"rank {rank} step {step}")
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], atol=1e-5
        )
        assert max_rel(result["weights"], reference["weights"]) < 1e-4
        # Each rank computed its half of every batch.
        split_probe.assert_divided(result["split"], 64, 2)


def test_a_plain_model_evaluated_on_rank_0_alone_starts_no_collective():
    # Inside a distributed fit whose metrics are made global per epoch, a
    # callback evaluates a plain model on rank 0 only. Keras's CallbackList
    # of that run must not make this fit's metrics global (a collective on
    # one rank: the ranks' collectives no longer matched).
    from keras_parallel.backends.torch.keras_compat import torch_trainer_with_ddp

    if torch_trainer_with_ddp is not None:
        pytest.skip(
            "Keras 3.16+ wraps every model in its own DDP under a process "
            "group: a plain model run on one rank alone is a collective there"
        )
    case = dict(variant="metrics", nested="plain_on_rank_0")
    results = _launch(workers.guide_scenarios, 2, args=([case],), collective_timeout=30)
    reference = workers.guide_train(**dict(case, distributed=False))
    for rank, (result,) in enumerate(results):
        _assert_logs_equal(result["history"], reference["history"], f"rank {rank}")
        assert max_rel(result["weights"], reference["weights"]) < 1e-4


# --------------------------------------------------------- four processes
def test_four_ranks_equal_single_process(single):
    cases = [CASES["ten_steps"], CASES["uneven_epoch"]]
    results = _launch(workers.scenarios, 4, args=(cases,))
    for index, name in enumerate(["ten_steps", "uneven_epoch"]):
        ranks = [r[index] for r in results]
        for rank in ranks:  # Each rank computed its quarter of every batch.
            split_probe.assert_divided(rank["split"], 64, 4)
        for other in ranks[1:]:
            for a, b in zip(other["weights"], ranks[0]["weights"], strict=True):
                np.testing.assert_array_equal(a, b)
        assert max_rel(ranks[0]["weights"], single[name]["weights"]) < 1e-4
        assert set(ranks[0]["evaluation"]) == set(single[name]["evaluation"])
        for key, value in single[name]["evaluation"].items():
            np.testing.assert_allclose(ranks[0]["evaluation"][key], value, rtol=1e-5)
        np.testing.assert_allclose(
            ranks[0]["predictions"], single[name]["predictions"], atol=1e-5
        )


@pytest.mark.parametrize("built", [True, False], ids=["built", "planned_in_fit"])
def test_rank_zero_alone_prints_and_writes(tmp_path, built):
    # Planned in fit: the plan, and what only rank 0 runs, come after Keras
    # made the run's callbacks; they are taken out of that run too.
    outputs = _launch(workers.chief_writes, 2, args=(str(tmp_path), built))
    printed = [text for text, _, _ in outputs]
    assert "cpu:1" in printed[0] and "loss" in printed[0]  # Plan, progress.
    assert printed[1].strip() == ""
    # Rank 0's writes land half a second late: `fit` (its ModelCheckpoint)
    # and `model.save` return on rank 1 once they are in place, and
    # `load_model` right after `save` reads the weights saved.
    for rank, (_, _, found) in enumerate(outputs):
        assert found == {"checkpoint_after_fit": True, "loaded_as_saved": True}, (
            rank,
            found,
        )
    for _, names, _ in outputs:
        # Written once, by rank 0: rank 1's own CSV, model and weights paths
        # were never written.
        assert names == [
            "log-0.csv",
            "model.keras",
            "saved-0.keras",
            "saved-0.weights.h5",
        ]
    rows = (tmp_path / "log-0.csv").read_text().splitlines()
    assert len(rows) == 3  # Header and two epochs, not four.


# ------------------------------------------------------------- bad input
def test_different_data_sizes_across_ranks_fail_with_what_to_do():
    # The same number of steps (16): only the rows of the last batch differ.
    with pytest.raises(ValueError, match="data of different sizes") as raised:
        _launch(workers.uneven_data, 2, collective_timeout=30)
    assert "rank 0: 1003 rows" in str(raised.value)
    assert "rank 1: 1000 rows" in str(raised.value)


DIFFERENT_DATA_CASES = [
    ("mixin", "fit"),
    ("mixin", "evaluate"),
    ("mixin", "predict"),
    ("callback", "fit"),
]


def test_different_step_counts_fail_on_every_rank_before_a_collective():
    # 1003 rows on rank 0, 900 on rank 1: 16 steps against 15, verbose=0.
    # Unchecked, the first collective that differed aborted rank 1 in gloo
    # (SIGABRT, "Received data size doesn't match expected size").
    start = time.monotonic()
    results = _launch(
        workers.different_data, 2, args=(DIFFERENT_DATA_CASES,), collective_timeout=30
    )
    assert time.monotonic() - start < 120
    for index, case in enumerate(DIFFERENT_DATA_CASES):
        on_rank_0, on_rank_1 = (messages[index] for messages, _ in results)
        assert on_rank_0 is not None, f"{case} did not raise"
        assert on_rank_0 == on_rank_1, case  # The same error on both ranks.
        assert "data of different sizes" in on_rank_0, case
        assert "rank 0: 1003 rows, 16 steps" in on_rank_0, case
        assert "rank 1: 900 rows, 15 steps" in on_rank_0, case
    # Both ranks trained together afterwards: no collective ran while the
    # errors unwound.
    assert results[0][1] == results[1][1]


def test_batch_smaller_than_process_count_fails_with_what_to_do():
    with pytest.raises(ValueError, match=r"use batch_size >= 2"):
        _launch(workers.tiny_batch, 2, collective_timeout=30)


# ---------------------------------------------- the guide's convnet, digits
DIGITS_EPOCHS = 20  # Measured: 0.958 test accuracy with 2 ranks (30: 0.989).


@pytest.mark.slow
def test_guide_convnet_reaches_90_percent_through_launch():
    accuracies = _launch(workers.digits_accuracy, 2, args=(DIGITS_EPOCHS, 32))
    assert accuracies[0] == accuracies[1]
    assert accuracies[0] >= 0.90


def _run_with_torchrun_environment(code, world=2, cwd=None):
    """Runs `code` in `world` processes given what torchrun gives each one:
    the environment variables, nothing else (rank 0 hosts the store, as
    without torchrun's agent). Returns each rank's stdout.
    """
    import subprocess
    import sys

    from subprocesses import checkout_env

    from keras_parallel.launcher.ports import free_port

    port = free_port()
    processes = []
    for rank in range(world):
        env = checkout_env(
            KERAS_BACKEND="torch",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
            KERAS_PARALLEL_TIMEOUT="60",
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=cwd,
            )
        )
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=LAUNCH_TIMEOUT)
            assert process.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return outputs


def test_torchrun_environment_trains_as_one_process(single, tmp_path):
    # The unchanged script under torchrun: the group comes from the
    # environment alone, and the weights equal single-process training.
    code = (
        "import numpy as np, torch_workers as w; "
        "r = w.train(steps=10); "
        "np.save(f'weights{r[\"rank\"]}.npy', np.concatenate("
        "[a.ravel() for a in r['weights']]))"
    )
    _run_with_torchrun_environment(code, cwd=tmp_path)
    ranks = [np.load(tmp_path / f"weights{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(ranks[0], ranks[1])
    reference = np.concatenate([a.ravel() for a in single["ten_steps"]["weights"]])
    assert rel(ranks[0], reference) < 1e-4


@pytest.mark.slow
def test_guide_convnet_reaches_90_percent_from_torchrun_environment():
    outputs = _run_with_torchrun_environment(
        "import torch_workers as w; "
        f"print('ACCURACY', w.digits_accuracy({DIGITS_EPOCHS}, 32))"
    )
    accuracies = [
        float(line.split()[1])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("ACCURACY")
    ]
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]
    assert accuracies[0] >= 0.90
