"""ModelParallel on torch: DTensor variables under plain `model.fit`.

The proof is equivalence, as on JAX (tests/test_jax_model.py): 4 gloo processes
on meshes `(4, 1)`, `(2, 2)` and `(1, 4)` of axes `("data", "model")` train
from the same initial weights, on the same global batches, with SGD, to the
weights one device reaches, while each process holds only its shards. All
cases share one launch (`keras_parallel.launch`) to keep the suite short on
a small machine; the single-device references run in this process.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import split_probe

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch executor tests"
)

import hub_models  # noqa: E402
import torch_model_parallel_workers as workers  # noqa: E402

import keras_parallel  # noqa: E402

MESHES = [(4, 1), (2, 2), (1, 4)]
CASES = {}
for _mesh in MESHES:
    _m = f"{_mesh[0]}x{_mesh[1]}"
    CASES[f"mlp_one_step_{_m}"] = dict(kind="mlp", mesh=_mesh, steps=1, inspect=True)
    CASES[f"mlp_ten_steps_{_m}"] = dict(kind="mlp", mesh=_mesh, steps=10, n=640)
    # 1003 samples at batch 64: a last batch of 43, which no data axis
    # here divides; evaluate and predict (203 rows: 64, 64, 64, 11) too.
    CASES[f"mlp_epoch_{_m}"] = dict(
        kind="mlp", mesh=_mesh, steps=None, n=1003, evaluate=True
    )
    CASES[f"convnet_one_step_{_m}"] = dict(kind="convnet", mesh=_mesh, steps=1)
# Megatron-LM's splits, the benchmark's MLP (benchmarks/bench_torch_model_parallel.py).
CASES["megatron_one_step_1x4"] = dict(
    kind="megatron", mesh=(1, 4), steps=1, inspect=True
)
CASES["transformer_ten_steps_2x2"] = dict(
    kind="transformer", mesh=(2, 2), steps=10, n=640, evaluate=True
)
# No LayoutMap: layouts derived from the layers (ModelParallel(rules="auto")),
# through the ShardingCallback door; Llama's 2 key/value heads divide the
# model axis of 2 here.
CASES["transformer_rules_2x2"] = dict(
    kind="transformer", mesh=(2, 2), steps=1, rules="auto"
)
# The rules with shard="full": the batch axis on what they leave free.
CASES["transformer_rules_full_2x2"] = dict(
    kind="transformer", mesh=(2, 2), steps=1, rules="auto", shard="full"
)
# KerasHub's backbones where it imports (not with keras-nightly 3.16, whose
# torch-nightly env runs this file): test_kerashub_imports_here says so.
ON_TORCH = keras.backend.backend() == "torch"
HUB_CASES = workers.HUB_FAMILIES if ON_TORCH and hub_models.available() else ()
for _family in HUB_CASES:
    CASES[f"{_family}_rules_2x2"] = dict(
        kind=_family, mesh=(2, 2), steps=1, rules="auto"
    )
if HUB_CASES:
    CASES["llama_scope_rules_2x2"] = dict(
        kind="llama", mesh=(2, 2), steps=1, rules="auto", in_scope=True
    )
RULES = [name for name in CASES if "rules" in name]
ONE_STEP = {name for name, case in CASES.items() if case["steps"] == 1}
SAVED = "mlp_epoch_2x2"


def _launch(fn, n, args=(), **kwargs):
    from torch_launch import launch

    kwargs.setdefault("timeout", 300)
    kwargs.setdefault("collective_timeout", 60)
    return launch(fn, n, args=args, **kwargs)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("saved"))


@pytest.fixture(scope="module")
def four_ranks(saved_dir):
    names = list(CASES)
    cases = [
        dict(CASES[k], save_to=saved_dir) if k == SAVED else CASES[k] for k in names
    ]
    results = _launch(
        workers.scenarios, 4, args=(cases, True, saved_dir, True, saved_dir)
    )
    out = {name: [rank[i] for rank in results] for i, name in enumerate(names)}
    out["bad_inputs"] = results[0][len(names)]
    out["checkpoints"] = [rank[len(names) + 1] for rank in results]
    out["jax_written"] = [rank[len(names) + 2] for rank in results]
    out["after_fit"] = [rank[len(names) + 3] for rank in results]
    return out


@pytest.fixture(scope="module")
def single():
    return {
        name: workers.train(**dict(case, distributed=False, inspect=False))
        for name, case in CASES.items()
    }


def max_rel(weights, reference):
    """The largest difference, relative to each variable's largest value.

    A variable whose values all stay below 1e-3 of the model's largest
    weight is compared at that scale: a conv bias before a BatchNorm, or
    the attention's key bias, has a zero gradient in exact arithmetic and
    holds only rounding noise, which no relative measure of its own fits.
    """
    assert weights, "no weights to compare"
    assert len(weights) == len(reference), (len(weights), len(reference))
    floor = 1e-3 * max(float(np.max(np.abs(b))) for b in reference)
    return max(
        float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor)
        for a, b in zip(weights, reference, strict=True)
    )


# ------------------------------------------------------------ one process
def test_only_a_mesh_that_splits_more_than_the_batch_needs_dtensors():
    from keras_parallel.backends.torch.model_parallel import splits_model

    def model_parallel(shape):
        devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
        mesh = keras.distribution.DeviceMesh(shape, ["data", "model"], devices)
        return keras.distribution.ModelParallel(
            layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="data"
        )

    assert not splits_model(model_parallel((4, 1)))  # Data parallelism: DDP.
    assert splits_model(model_parallel((2, 2)))
    assert splits_model(model_parallel((1, 4)))


def test_jit_compile_runs_the_mesh_steps_uncompiled_and_says_so():
    # torch.compile of a DTensor forward fails in AOTAutograd: the mesh's
    # steps keep the model's own `call`, and warn once (docs/torch.md).
    from keras_parallel.backends.torch.mesh_steps import MeshSteps

    model = keras.Sequential([keras.layers.Dense(2)])
    model.compile(loss="mse", jit_compile=True)
    steps = object.__new__(MeshSteps)
    steps.model, steps._warned_jit = model, False
    with pytest.warns(UserWarning, match="jit_compile=True is not applied"):
        assert steps._forward(model.call) == model.call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert steps._forward(model.call) == model.call  # Once only.
    model.compile(loss="mse", jit_compile=False)
    steps._warned_jit = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert steps._forward(model.call) == model.call


def test_placements_follow_the_layout_axes():
    from torch.distributed.tensor import Replicate, Shard

    from keras_parallel.backends.torch.dtensor_layouts import placements

    axes = ("data", "model")
    assert placements((None, "model"), axes) == (Replicate(), Shard(1))
    assert placements(("model", "data", None), axes) == (Shard(1), Shard(0))
    assert placements((None,), axes) == (Replicate(), Replicate())


_LIST_DEVICES = (
    "print(keras.distribution.list_devices(), "
    "keras.distribution.get_device_count(), "
    "keras.distribution.list_devices('gpu'))"
)


@pytest.mark.parametrize(
    "imports, world",
    [
        ("import keras_parallel, keras", None),
        ("import keras, keras_parallel", "4"),
        # Keras first imported by keras_parallel's own version check.
        ("import keras_parallel; keras_parallel.DistributedModel; import keras", "4"),
    ],
)
def test_keras_lists_torch_devices_as_keras_3_16_does(imports, world):
    # Keras 3.15 has no torch distribution_lib: `list_devices()` raised
    # AttributeError on None. keras_parallel gives it Keras 3.16's functions
    # when Keras is imported, before or after keras_parallel, with no other
    # keras_parallel code run. Under torchrun's WORLD_SIZE, one device per
    # process (as under a gloo group: see the JAX-written script below).
    # (One process per case: each import order once, each WORLD_SIZE at
    # least once.)
    import subprocess
    import sys

    from subprocesses import checkout_env

    expected = {
        None: "['cpu:0'] 1 []",
        "4": "['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3'] 4 []",
    }
    env = checkout_env(KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("WORLD_SIZE", None)
    if world is not None:
        env["WORLD_SIZE"] = world
    result = subprocess.run(
        [sys.executable, "-c", f"{imports}; {_LIST_DEVICES}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == expected[world], (world, imports)


def test_gpu_names_from_keras_are_torch_cuda_devices():
    # Keras lists a CUDA device as "gpu:i"; the plan checks names against
    # the executor's `cuda:i`.
    from keras_parallel.backends.torch.executor import TorchExecutor

    executor = TorchExecutor(keras_parallel.DataParallel())
    assert executor.device_names(["gpu:0", "CPU:1", "cuda:2"]) == [
        "cuda:0",
        "cpu:1",
        "cuda:2",
    ]


def test_model_parallel_larger_than_the_process_group_is_refused():
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["data", "model"], [f"cpu:{i}" for i in range(4)]
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"
    )
    with pytest.raises(
        keras_parallel.ShardingError, match="one process per device.*fewer"
    ):
        keras_parallel.ShardingCallback(distribution)


# --------------------------------------------------------- four processes
@pytest.mark.parametrize("name", list(CASES))
def test_weights_equal_one_device(four_ranks, single, name):
    ranks = four_ranks[name]
    for other in ranks[1:]:  # Every process gathers the same whole weights.
        for a, b in zip(other["weights"], ranks[0]["weights"], strict=True):
            np.testing.assert_array_equal(a, b)
    tolerance = 1e-5 if name in ONE_STEP else 1e-4
    assert max_rel(ranks[0]["weights"], single[name]["weights"]) < tolerance
    np.testing.assert_allclose(ranks[0]["loss"], single[name]["loss"], rtol=1e-5)


def test_a_mesh_written_as_for_jax_trains_as_one_device(four_ranks, single):
    # docs/jax.md's script, unchanged: `keras.distribution.list_devices()`
    # first thing in the process, a (2, 2) mesh of those devices, a
    # LayoutMap, ModelParallel, compile, fit. It failed on Keras 3.15
    # (no torch distribution_lib) before any keras_parallel code ran.
    ranks = four_ranks["jax_written"]
    reference = single["mlp_epoch_2x2"]
    for result in ranks:
        assert "error" not in result, result.get("error")
        # What Keras 3.16's torch backend lists under a group of 4 processes.
        assert result["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        # Each batch split over the data axis (2); the last (43 rows, odd)
        # is computed whole, as docs/torch.md says.
        split_probe.assert_divided(result["split"], 64, 2, uneven_whole=True)
        for a, b in zip(result["weights"], ranks[0]["weights"], strict=True):
            np.testing.assert_array_equal(a, b)
        assert result["evaluation"] == pytest.approx(reference["evaluation"], rel=1e-5)
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], atol=1e-5
        )
    assert max_rel(ranks[0]["weights"], reference["weights"]) < 1e-4
    np.testing.assert_allclose(ranks[0]["loss"], reference["loss"], rtol=1e-5)
    # The same run as the case built from keras_parallel's device list.
    for a, b in zip(
        ranks[0]["weights"], four_ranks["mlp_epoch_2x2"][0]["weights"], strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_kerashub_imports_here():
    hub_models.require()
    assert HUB_CASES


@pytest.mark.parametrize("name", RULES)
def test_derived_layouts_split_every_kernel_and_the_batch(four_ranks, name):
    for result in four_ranks[name]:
        placements = result["placements"]
        kernels = [p for p in placements if p.endswith("kernel")]
        model = workers.build(CASES[name]["kind"], False)
        every_kernel = [v.path for v in model.weights if v.path.endswith("kernel")]
        # Each kernel split over `model` (the output layer's 48 logits too).
        assert sorted(kernels) == sorted(every_kernel)
        full = CASES[name].get("shard") == "full"
        for path in kernels:
            placement, local = placements[path]
            assert "S(" in placement[1], path  # Split over `model`...
            # ... and with shard="full" over `data` too, on another dimension.
            on_data = placement[0]
            assert on_data.startswith("S(") if full else on_data == "R", path
            whole = dict((v.path, tuple(v.shape)) for v in model.weights)[path]
            ways = 4 if full else 2
            assert ways * int(np.prod(local)) == int(np.prod(whole)), path
        if name == "transformer_rules_2x2":
            # Megatron's pair: the gate split by its outputs, the next by
            # its inputs.
            assert placements["ffw_gating/kernel"][0] == ["R", "S(1)"]
            assert placements["ffw_linear/kernel"][0] == ["R", "S(0)"]
        if CASES[name]["kind"] in workers.HUB_FAMILIES:
            # The rows this rank computed in the one step, the last call
            # recorded: half of the batch of 64. The calls before it are
            # not steps: Keras's symbolic build of the model, which runs it
            # eagerly where the "meta" device fails (KerasHub's layers),
            # and the rules' trace of one row.
            assert result["split"][-1] == (64, 32), result["split"]
        if CASES[name].get("in_scope"):
            # Made in its shards, where the plan then left it.
            made = {p: v for p, v in result["made"].items() if p.endswith("kernel")}
            assert made == {p: placements[p] for p in kernels}


def test_training_moved_the_weights(four_ranks):
    # Equality with one device means something only if training moved them.
    initial = [np.asarray(w) for w in workers.build("mlp", False).get_weights()]
    assert max_rel(four_ranks["mlp_epoch_2x2"][0]["weights"], initial) > 1e-2


@pytest.mark.parametrize("mesh", ["2x2", "1x4"])
def test_each_process_holds_its_shard_as_describe_says(four_ranks, mesh):
    model_axis = int(mesh[-1])
    for result in four_ranks[f"mlp_one_step_{mesh}"]:
        # Bytes held = the plan's bytes per device < the whole model.
        assert result["held_bytes"] == result["plan_bytes"]
        assert result["plan_bytes"] < result["total_bytes"]
        placements = result["placements"]
        assert placements["d1/kernel"] == (["R", "S(1)"], (16, 32 // model_axis))
        assert placements["d2/kernel"] == (["R", "S(0)"], (32 // model_axis, 8))
        # The optimizer slots are split like their variables.
        assert placements["sgd/d1_kernel_momentum"] == placements["d1/kernel"]
        assert placements["sgd/d2_kernel_momentum"] == placements["d2/kernel"]
        assert f"{result['held_bytes'] / 1024:.1f} KiB of" in result["describe"]


@pytest.mark.parametrize("name", ["megatron_one_step_1x4", "mlp_one_step_2x2"])
def test_split_variables_gradients_are_computed_as_their_shards(four_ranks, name):
    # Megatron's d2 (rows split) follows d1 (columns split). Left to DTensor,
    # the matmul's partial sums are finished by a reduce-scatter along the
    # batch; the gradients then come back split along the batch, and d1's
    # are computed whole on every process and cut to the shard afterwards:
    # a whole gradient's memory each step (`FinishedSums`).
    model_size = CASES[name]["mesh"][1]
    for result in four_ranks[name]:
        arriving = result["arriving_gradients"]
        assert arriving, "no gradient of a split variable was recorded"
        for global_shape, computed in arriving:
            assert np.prod(computed) * model_size == np.prod(global_shape), (
                global_shape,
                computed,
            )


def test_describe_prints_the_plan_table_one_process_plans(four_ranks):
    text = four_ranks["mlp_one_step_2x2"][0]["describe"]
    assert "Backend: torch, 4 devices in 4 processes" in text
    assert "Mesh: data=2, model=2" in text
    # The table JAX prints for the same model and LayoutMap: the same plan.
    assert workers.table_of(text) == workers.plan_table("mlp", (2, 2))


def test_output_key_redistributes_the_layer_output(four_ranks):
    # d2's output is a partial sum over `model`; without its key it would be
    # finished (["S(0)", "R"]). The key splits its columns over `model`.
    for mesh in ("2x2", "1x4"):
        result = four_ranks[f"mlp_one_step_{mesh}"][0]
        assert result["plan_outputs"] == [("d2/output", "d2/output", ("data", "model"))]
        assert result["d2_output"] == ["S(0)", "S(1)"]


@pytest.mark.parametrize("mesh", ["4x1", "2x2", "1x4"])
def test_evaluate_and_predict_equal_one_device(four_ranks, single, mesh):
    name = f"mlp_epoch_{mesh}"
    for result in four_ranks[name]:
        assert result["evaluation"] == pytest.approx(
            single[name]["evaluation"], rel=1e-5
        )
        assert result["predictions"].shape == (203, 8)  # Gathered, in order.
        np.testing.assert_allclose(
            result["predictions"], single[name]["predictions"], atol=1e-5
        )


def test_transformer_block_predicts_as_one_device(four_ranks, single):
    name = "transformer_ten_steps_2x2"
    for result in four_ranks[name]:
        assert result["evaluation"] == pytest.approx(
            single[name]["evaluation"], rel=1e-5
        )
        np.testing.assert_allclose(
            result["predictions"], single[name]["predictions"], atol=1e-4
        )


def test_saved_sharded_model_loads_on_one_device(four_ranks, saved_dir):
    loaded = keras.saving.load_model(os.path.join(saved_dir, "mlp.keras"))
    assert type(loaded).__name__ == "Functional"  # Plain Keras, one device.
    for a, b in zip(loaded.get_weights(), four_ranks[SAVED][0]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    x, _ = workers.data("mlp", 203)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), four_ranks[SAVED][0]["predictions"], atol=1e-5
    )
    # The momentum slots were saved whole too.
    assert loaded.optimizer.iterations.numpy() == 16


def test_backup_resumes_model_parallel_exactly(four_ranks):
    for runs in four_ranks["checkpoints"]:
        assert runs["interrupted"] is None  # It stopped in its second epoch.
        assert max_rel(runs["resumed"], runs["uninterrupted"]) < 1e-6
    initial = [np.asarray(w) for w in workers.build("mlp", False).get_weights()]
    assert max_rel(runs["uninterrupted"], initial) > 1e-2


@pytest.mark.parametrize("run", ["uninterrupted", "resumed"])
def test_model_checkpoint_of_model_parallel_loads_on_one_device(
    four_ranks, saved_dir, run
):
    path = os.path.join(saved_dir, run, "checkpoint.keras")
    loaded = keras.saving.load_model(path)  # Plain Keras, one process.
    assert type(loaded).__name__ == "Functional"
    # The last epoch's checkpoint holds the weights the run ended with.
    final = four_ranks["checkpoints"][0][run]
    for a, b in zip(loaded.get_weights(), final, strict=True):
        np.testing.assert_array_equal(a, b)


def test_keras_reads_and_writes_split_weights_after_a_callback_door_fit(
    four_ranks, single, saved_dir
):
    # After `fit(callbacks=[ShardingCallback(...)])` of a plain Keras model
    # the split variables stay DTensors. Keras's own methods read and write
    # them on every rank: `Variable.numpy()` gathers the whole value
    # (`get_weights()`, of the model and of a layer; it raised ".numpy() is
    # not supported for tensor subclasses"), `assign` takes a whole value
    # (`set_weights`, `load_weights`; it raised "got mixed torch.Tensor and
    # DTensor"), and `save_weights` gathers, rank 0 writing.
    split = {
        "d1/kernel": ["R", "S(1)"],
        "d1/bias": ["R", "S(0)"],
        "d2/kernel": ["R", "S(0)"],
    }
    ranks = four_ranks["after_fit"]
    for result in ranks:
        assert "error" not in result, result.get("error")
        for placed in ("split", "still_split"):  # Assigned shard by shard.
            assert {k: result[placed].get(k) for k in split} == split, placed
        whole = result["whole"]  # Each variable's `full_tensor()`.
        doubled = [2 * w for w in whole]
        for name, expected in [
            ("weights", whole),
            ("d1", whole[:2]),  # `d1`'s kernel and bias.
            ("set", doubled),
            ("set_whole", doubled),
            ("loaded", doubled),
            ("loaded_whole", doubled),
        ]:
            assert len(result[name]) == len(expected), name
            for a, b in zip(result[name], expected, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=name)
        for a, b in zip(whole, ranks[0]["whole"], strict=True):
            np.testing.assert_array_equal(a, b)
    # The same training as the compile door's, as one device's.
    for a, b in zip(
        ranks[0]["whole"], four_ranks["mlp_ten_steps_2x2"][0]["weights"], strict=True
    ):
        np.testing.assert_array_equal(a, b)
    reference = single["mlp_ten_steps_2x2"]["weights"]
    assert max_rel(ranks[0]["whole"], reference) < 1e-4
    # The file rank 0 wrote loads into plain Keras on one device.
    plain = workers.build("mlp", False)
    plain.load_weights(os.path.join(saved_dir, "after_fit.weights.h5"))
    for a, b in zip(plain.get_weights(), ranks[0]["set"], strict=True):
        np.testing.assert_array_equal(a, b)
    # So does the model rank 0 saved, its split variables gathered first.
    loaded = keras.saving.load_model(os.path.join(saved_dir, "after_fit.keras"))
    for a, b in zip(loaded.get_weights(), ranks[0]["set"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_layer_outputs_without_a_key_finish_sums_and_split_the_batch_on_its_axis():
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard

    from keras_parallel.backends.torch.output_constraints import OutputConstraints

    def placed(placements, batch_dim=0, whole=False):
        steps = SimpleNamespace(batch_dim=batch_dim, whole=whole)
        leaf = SimpleNamespace(placements=placements)
        return OutputConstraints(steps)._default_placements(leaf)

    # Mesh ("data", "model"), batch along "data".
    assert placed((Shard(0), Partial())) == (Shard(0), Replicate())
    assert placed((Replicate(), Shard(0))) == (Replicate(), Replicate())
    assert placed((Shard(0), Shard(1))) == (Shard(0), Shard(1))
    # A batch computed whole is split nowhere.
    assert placed((Shard(0), Shard(2)), whole=True) == (Replicate(), Shard(2))


def test_bad_inputs_fail_with_the_plans_words(four_ranks):
    errors = four_ranks["bad_inputs"]
    assert (
        "needs one process per device of its mesh, but fewer"
        in (errors["fewer processes"])
    )
    assert "(8 devices) and 4 process(es)" in errors["fewer processes"]
    assert (
        "needs one process per device of its mesh, but more"
        in (errors["more processes"])
    )
    # The same texts as on JAX: they come from the plan.
    assert errors["rank"].startswith(
        "The layout of LayoutMap key 'd1/kernel' has rank 3, but variable"
    )
    assert errors["two keys"].startswith(
        "Variable 'd1/kernel' is matched by 2 LayoutMap keys"
    )
    assert errors["indivisible"].startswith(
        "Variable 'd2/kernel' cannot be split over mesh axis 'model'"
    )
