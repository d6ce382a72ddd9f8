"""`shard=` on torch: DTensor shards of variables and Adam state under `fit`.

4 gloo processes train `builders.wide_mlp` with Adam under
`keras_parallel.DataParallel(shard=...)` to the weights one device reaches
(plain Keras, same initial weights, same global batches), while each holds
a quarter of each large kernel and of its Adam slots; every equivalence
also proves the batch was split (`split_probe`). The same launch checks
gradient accumulation (DDP: no all-reduce on micro-steps), a model built
inside `distribution.scope()` (never whole on a process) and checkpoints.
All 4-process checks share one launch (`torch_sharding_workers.four_ranks`)
to keep the file short on a small machine; the one-device references run in
this process.
"""

import os

import keras
import numpy as np
import pytest
import split_probe
from builders import max_relative_difference, wide_mlp

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch executor tests"
)

import torch_sharding_workers as workers  # noqa: E402

import keras_parallel  # noqa: E402

SHARDS = ("full", "optimizer")


def _launch(fn, n, args=()):
    from torch_launch import launch

    return launch(fn, n, args=args, timeout=400, collective_timeout=60)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sharding"))


@pytest.fixture(scope="module")
def deep_weights(folder):
    """Weights of `deep_mlp` (another seed), written by one device."""
    path = os.path.join(folder, "deep.weights.h5")
    workers.deep_mlp(keras.Model, seed=9).save_weights(path)
    return path


@pytest.fixture(scope="module")
def four_ranks(folder, deep_weights):
    ranks = _launch(workers.four_ranks, 4, args=(folder, deep_weights))
    for rank in ranks:
        for name, result in rank.items():
            assert not (isinstance(result, dict) and "error" in result), (
                name,
                result.get("error"),
            )
    return ranks


@pytest.fixture(scope="module")
def single():
    return {
        "convnet": workers.convnet(None, distributed=False, optimizer="sgd"),
        "convnet_adam": workers.convnet(None, steps=(1,), distributed=False),
        "steps": workers.train(None, distributed=False),
        "accumulated": workers.train(None, steps=(8,), accumulate=4, distributed=False),
    }


def _same_on_every_rank(ranks, name):
    for rank in ranks[1:]:
        for a, b in zip(
            rank[name]["weights"][-1], ranks[0][name]["weights"][-1], strict=True
        ):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------ one process
def test_shard_runs_on_dtensors_even_on_a_one_axis_mesh():
    from keras_parallel.backends.torch.model_parallel import runs_on_mesh

    devices = [f"cpu:{i}" for i in range(4)]
    for shard in SHARDS:
        assert runs_on_mesh(keras_parallel.DataParallel(devices=devices, shard=shard))
    assert not runs_on_mesh(keras_parallel.DataParallel(devices=devices))  # DDP.
    # One device splits nothing: plain Keras.
    assert not runs_on_mesh(
        keras_parallel.DataParallel(devices=["cpu:0"], shard="full")
    )


# --------------------------------------------------------- four processes
@pytest.mark.parametrize("shard", SHARDS)
def test_sharded_adam_trains_as_one_device(four_ranks, single, shard):
    _same_on_every_rank(four_ranks, shard)
    one_step, ten_steps = four_ranks[0][shard]["weights"]
    reference_one, reference_ten = single["steps"]["weights"]
    assert max_relative_difference(one_step, reference_one) <= 1e-5
    assert max_relative_difference(ten_steps, reference_ten) <= 1e-4
    initial = [np.asarray(w) for w in wide_mlp(keras.Model).get_weights()]
    assert max_relative_difference(ten_steps, initial) > 1e-2  # It trained.
    for rank in four_ranks:  # Each rank computed 16 rows of every 64.
        split_probe.assert_divided(rank[shard]["split"], 64, 4)


def _relative(expected, got, leave_out=()):
    """`max_relative_difference` of two `[(path, array)]` lists, in order.

    A variable of pure rounding noise (`large_k/bias`, before a BatchNorm:
    zero gradient in exact arithmetic) is compared at 1e-3 of the model's
    largest weight, as in test_torch_model_parallel.py; `leave_out` names
    those not compared at all.
    """
    kept = [
        (a, b)
        for (path, a), (_, b) in zip(expected, got, strict=True)
        if path not in leave_out
    ]
    return max_relative_difference(
        [a for a, _ in kept], [b for _, b in kept], noise_floor=1e-3
    )


@pytest.mark.parametrize("shard", SHARDS)
def test_guide_convnet_trains_as_one_device(four_ranks, single, shard):
    # In float64 (`workers.convnet` says why). SGD with momentum, 1 and 10
    # steps: measured 8e-7 and 4e-7 (in float32, one device alone, moved
    # by one rounding, reached 1.2e-2 after 10 steps for some roundings).
    key = f"{shard}_convnet"
    one_step, ten_steps = four_ranks[0][key]["weights"]
    reference_one, reference_ten = single["convnet"]["weights"]
    assert _relative(reference_one, one_step) <= 1e-5
    assert _relative(reference_ten, ten_steps) <= 1e-5
    # Adam, 1 step (measured 2.6e-5): Adam's first step moves each weight
    # by lr * g / (|g| + epsilon), which turns the rounding of a gradient
    # near epsilon into a visible move, and Keras's BatchNormalization
    # computes its statistics in float32 even in a float64 model. A weight
    # whose gradient is all rounding (`large_k/bias`: exactly zero before a
    # BatchNorm) moves by a random +-lr on one device and on four alike: it
    # is left out.
    adam = four_ranks[0][f"{shard}_convnet_adam"]["weights"][0]
    expected = single["convnet_adam"]["weights"][0]
    assert _relative(expected, adam, leave_out=("large_k/bias",)) <= 5e-5
    for rank in four_ranks:
        rows = rank[key]["rows"]
        assert rows and all(r == 16 for r in rows), rows  # 16 of every 64.
        held = rank[key]["held"]
        # The convolution kernels of 10368 and 27648 elements and the hidden
        # Dense kernel (8192); the first (108) and last (2560) stay whole.
        split = [p for p, (local, whole) in held.items() if local * 4 == whole]
        assert len(split) == (3 if shard == "full" else 0), held


@pytest.mark.parametrize("shard", SHARDS)
def test_each_process_holds_a_quarter_of_the_sharded_state(four_ranks, shard):
    for rank in four_ranks:
        held = rank[shard]["held"]
        assert len(held) == 6, sorted(held)  # 2 kernels, 2 Adam slots each.
        for path, (placements, local, whole) in held.items():
            kernel = path in workers.LARGE
            if kernel and shard == "optimizer":
                assert placements == ["R"], path  # Whole on every process.
                assert local == whole, path
            else:
                assert placements in (["S(0)"], ["S(1)"]), (path, held)
                assert local * 4 == whole, (path, local, whole)


@pytest.mark.parametrize("shard", SHARDS)
def test_adam_updates_from_gradient_shards(four_ranks, shard):
    # The gradients reach Adam as shards, reduce-scattered: under
    # "optimizer" too (ZeRO-2), where the variable is whole.
    for rank in four_ranks:
        seen = rank[shard]["gradients"]
        assert {path for path, _, _ in seen} == set(workers.LARGE)
        shapes = {"d1/kernel": (256, 512), "d2/kernel": (512, 16)}
        for path, placements, local in seen:
            assert placements in (["S(0)"], ["S(1)"]), (path, placements)
            assert np.prod(local) * 4 == np.prod(shapes[path]), (path, local)


def test_ddp_gradient_accumulation_reduces_once_per_update(four_ranks, single):
    ranks = four_ranks
    _same_on_every_rank(ranks, "ddp_accumulated")
    result = ranks[0]["ddp_accumulated"]
    reference = single["accumulated"]["weights"][0]
    assert max_relative_difference(result["weights"][0], reference) <= 1e-4
    assert result["iterations"] == 2  # 8 steps of 4: 2 updates.
    for rank in ranks:
        split_probe.assert_divided(rank["ddp_accumulated"]["split"], 64, 4)
        buckets = rank["ddp_accumulated"]["buckets"]
        # DDP's gradient all-reduces per step: none on the micro-steps.
        assert len(buckets) == 8
        assert [buckets[i] for i in (0, 1, 2, 4, 5, 6)] == [0] * 6, buckets
        assert buckets[3] >= 1 and buckets[7] >= 1, buckets
        # The accumulators: one all-reduce per update.
        assert rank["ddp_accumulated"]["reduced_updates"] == 2


@pytest.mark.parametrize(
    "name,ways", [("full", 4), ("optimizer", 4), ("model_parallel", 2)]
)
def test_gradient_accumulation_trains_as_one_device(four_ranks, single, name, ways):
    # Each micro-step's gradient is reduced into the accumulator (under
    # `shard=`, reduce-scattered into its shard; docs: accumulation.py).
    key = f"{name}_accumulated"
    _same_on_every_rank(four_ranks, key)
    result = four_ranks[0][key]
    reference = single["accumulated"]["weights"][0]
    assert max_relative_difference(result["weights"][0], reference) <= 1e-4
    for rank in four_ranks:
        split_probe.assert_divided(rank[key]["split"], 64, ways)


def test_model_built_in_scope_is_never_whole_on_a_process(four_ranks, deep_weights):
    for rank in four_ranks:
        inside = rank["built_in_scope"]
        bound = inside["shards"] + inside["largest"]
        # Equal layers: no one variable is most of the model.
        assert inside["whole"] > bound
        assert inside["placed_when_built"] == {
            f"deep{i}/kernel": ["S(0)"] for i in range(4)
        }
        assert len(inside["trace"]) >= 4
        assert max(inside["trace"]) <= bound, inside["trace"]
        assert inside["after_compile"] == inside["shards"]
        # The same model built outside the scope is whole until compile.
        outside = rank["built_outside_scope"]
        assert max(outside["trace"]) > bound, outside["trace"]
        assert outside["after_compile"] == outside["shards"]
    # `load_weights` of a one-device file, then one step as one device.
    plain = workers.deep_mlp(keras.Model)
    plain.load_weights(deep_weights)
    result = four_ranks[0]["built_in_scope"]
    for a, b in zip(result["loaded"], plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    reference = workers.deep_one_device(deep_weights)
    assert max_relative_difference(result["weights"], reference) <= 1e-5


def test_backup_resumes_a_sharded_model_exactly(four_ranks):
    for rank in four_ranks:
        runs = rank["checkpoints"]
        assert runs["interrupted"] is None  # It stopped in its second epoch.
        assert max_relative_difference(runs["resumed"], runs["uninterrupted"]) < 1e-6
        split_probe.assert_divided(runs["resumed_split"], 64, 4)  # Resumed, split.
    initial = [np.asarray(w) for w in wide_mlp(keras.Model).get_weights()]
    assert max_relative_difference(runs["uninterrupted"], initial) > 1e-2


@pytest.mark.parametrize("run", ["uninterrupted", "resumed"])
def test_weights_checkpoint_of_a_sharded_model_loads_on_one_device(
    four_ranks, folder, run
):
    plain = wide_mlp(keras.Model, probe=True)
    plain.load_weights(os.path.join(folder, run, "checkpoint.weights.h5"))
    final = four_ranks[0]["checkpoints"][run]
    for a, b in zip(plain.get_weights(), final, strict=True):
        np.testing.assert_array_equal(a, b)


def test_weights_saved_by_four_processes_load_sharded_on_two(four_ranks, folder):
    path = os.path.join(folder, "uninterrupted", "checkpoint.weights.h5")
    ranks = _launch(workers.loaded_sharded, 2, args=(path,))
    final = four_ranks[0]["checkpoints"]["uninterrupted"]
    for rank in ranks:
        assert rank["placements"]["d1/kernel"] == ["S(1)"]
        for a, b in zip(rank["weights"], final, strict=True):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------- failure paths
@pytest.mark.parametrize("where", ["fit", "build"])
def test_a_rank_that_raises_while_sharded_is_named_within_seconds(where):
    import time

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 1 while sharded") as raised:
        _launch(workers.fail_while_sharded, 2, args=(where,))
    assert time.monotonic() - start < 60
    assert raised.value.rank == 1
    peer = raised.value.rank_errors[0]
    assert "PeerFailedError" in peer and "Rank 1 failed" in peer
