"""Keras's `OrbaxCheckpoint` under keras_parallel's JAX layouts.

A `(2, 4)` `ModelParallel` model trains with `keras.callbacks.OrbaxCheckpoint`
(Keras's own, unchanged): the checkpoint holds each array once, in its
layout. `keras_parallel.restore_checkpoint` reads it back into a fresh model
on the same mesh, on other meshes and on one device (also in a process with
a single device): the weights and the optimizer state equal the saved ones,
and every array lies where the new model's plan says.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="Orbax checkpoints (tox -e jax)"
)

from subprocesses import checkout_env  # noqa: E402

import keras_parallel  # noqa: E402
from keras_parallel.keras_seam.model_state import binding_of  # noqa: E402

pytest.importorskip(
    "orbax.checkpoint",
    reason="needs orbax-checkpoint (pip install keras-parallel[orbax])",
)

STEPS = 4


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def build(shape=(2, 4), seed=1, model_class=Net, width=64, head="d2"):
    """The MLP (16 -> width -> 8), `d1` split over `model`, compiled."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(width, activation="relu", name="d1")(inputs)
    outputs = keras.layers.Dense(8, name=head)(x)
    model = model_class(inputs=inputs, outputs=outputs, name="net")
    distribution = None
    if shape is not None:
        mesh = keras.distribution.DeviceMesh(shape, ["data", "model"])
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["d1/kernel"] = (None, "model")
        layout_map["d1/bias"] = ("model",)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="data"
        )
    kwargs = {} if distribution is None else {"distribution": distribution}
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", **kwargs)
    return model


def data(n=16 * STEPS):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, 16)).astype("float32"),
        rng.normal(size=(n, 8)).astype("float32"),
    )


def state_of(model):
    """`{path: value}` of the weights and the optimizer's state.

    The optimizer's name (`adam`, `adam_1`) is left out of its paths.
    """
    out = {v.path: np.asarray(v.value) for v in model.weights}
    for v in model.optimizer.variables:
        out["optimizer/" + v.path.split("/", 1)[1]] = np.asarray(v.value)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the (2, 4) model after STEPS steps, and its state."""
    directory = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    model = build()
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=16,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.OrbaxCheckpoint(directory, save_freq=STEPS)],
    )
    return directory, state_of(model)


def assert_state_equal(model, expected):
    got = state_of(model)
    assert expected, "no state to compare"
    assert sorted(got) == sorted(expected)
    for path, value in expected.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def assert_laid_out_per_plan(model, mesh_shape):
    """Every weight and optimizer variable lies on the plan's mesh and axes."""
    plan = binding_of(model).plan
    variables = list(model.weights) + list(model.optimizer.variables)
    entries = {e.path: e for e in plan.variables}
    for variable in variables:
        sharding = variable.value.sharding
        assert tuple(sharding.mesh.shape.values()) == mesh_shape, variable.path
        axes = tuple(entries[variable.path].axes)
        spec = tuple(sharding.spec) + (None,) * (len(axes) - len(sharding.spec))
        assert spec == axes, variable.path
    # The kernel is really split: each device holds a quarter of its columns.
    kernel = model.get_layer("d1").kernel.value
    columns = (
        kernel.shape[1]
        // dict(zip(["data", "model"], mesh_shape, strict=True))["model"]
    )
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, columns)}


def test_checkpoint_holds_each_array_once_in_its_layout(saved):
    import orbax.checkpoint as orbax

    directory, state = saved
    assert os.listdir(directory) == [str(STEPS)]
    metadata = orbax.v1.metadata(
        os.path.join(directory, str(STEPS)), checkpointable_name="pytree"
    ).metadata
    kernel = metadata["trainable_variables"]["d1"]["kernel"].sharding_metadata
    assert list(kernel.shape) == [2, 4]
    assert tuple(kernel.partition_spec) == (None, "model")
    # Each shard is written once: a kernel held by both rows of the mesh
    # (and d2, held by all 8 devices) is not written again per replica.
    pytree = os.path.join(directory, str(STEPS), "pytree")
    data_bytes = 0
    for root, _, files in os.walk(pytree):
        # What this process wrote, in OCDBT's data files.
        if root.endswith(os.path.join("ocdbt.process_0", "d")):
            data_bytes += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    state_bytes = sum(v.nbytes for v in state.values())
    assert state_bytes <= data_bytes < 1.5 * state_bytes


def test_restore_on_the_same_mesh(saved):
    directory, state = saved
    model = build(seed=7)
    assert keras_parallel.restore_checkpoint(model, directory) == STEPS
    assert_state_equal(model, state)
    assert_laid_out_per_plan(model, (2, 4))


@pytest.mark.parametrize("shape", [(4, 2), (1, 8)])
def test_restore_on_another_mesh(saved, shape):
    directory, state = saved
    model = build(shape, seed=7)
    keras_parallel.restore_checkpoint(model, directory)
    assert_state_equal(model, state)
    assert_laid_out_per_plan(model, shape)


def test_load_weights_of_a_distributed_model_reads_the_shards_into_its_layout(saved):
    directory, state = saved
    model = build((4, 2), seed=7)
    model.load_weights(directory)  # Keras's would use the saved (2, 4) mesh.
    assert_state_equal(model, state)
    assert_laid_out_per_plan(model, (4, 2))


def test_restore_on_one_device(saved):
    import jax

    directory, state = saved
    model = build(None, seed=7, model_class=keras.Model)
    keras_parallel.restore_checkpoint(model, os.path.join(directory, str(STEPS)))
    assert_state_equal(model, state)
    for variable in list(model.weights) + list(model.optimizer.variables):
        assert variable.value.sharding == jax.sharding.SingleDeviceSharding(
            jax.devices()[0]
        ), variable.path


def test_restore_in_a_process_with_one_device(saved):
    # Another machine: the 8 devices the checkpoint was saved from do not
    # exist. Keras's own `load_weights` fails here.
    directory, state = saved
    expected = os.path.join(os.path.dirname(directory), "expected.npz")
    np.savez(expected, **{k.replace("/", "|"): v for k, v in state.items()})
    code = (
        "import sys, numpy as np, keras, keras_parallel, jax\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "import test_orbax_checkpoint as t\n"
        "assert len(jax.devices()) == 1\n"
        "model = t.build(None, seed=7, model_class=keras.Model)\n"
        "keras_parallel.restore_checkpoint(model, sys.argv[1])\n"
        "with np.load(sys.argv[2]) as f:\n"
        "    t.assert_state_equal(model, {k.replace('|', '/'): f[k] for k in f})\n"
        "print('restored')\n"
    )
    env = checkout_env(
        XLA_FLAGS="--xla_force_host_platform_device_count=1", KERAS_BACKEND="jax"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", code, directory, expected, here],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "restored" in out.stdout


def test_unbuilt_optimizer_is_built_and_laid_out(saved):
    directory, state = saved
    model = build(seed=7)
    assert not model.optimizer.built
    keras_parallel.restore_checkpoint(model, directory)
    assert int(model.optimizer.iterations) == STEPS
    assert_laid_out_per_plan(model, (2, 4))


def test_training_resumes_from_the_restored_step(saved, tmp_path):
    directory, state = saved
    build(seed=3)  # this process's next optimizer is "adam_<n>", not "adam"
    model = build(seed=7)
    keras_parallel.restore_checkpoint(model, directory)
    assert_state_equal(model, state)
    resumed = str(tmp_path / "resumed")
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=16,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.OrbaxCheckpoint(resumed, save_freq=STEPS)],
    )
    # Keras's callback counts on from the restored optimizer step.
    assert os.listdir(resumed) == [str(2 * STEPS)]
    assert int(model.optimizer.iterations) == 2 * STEPS


def test_other_layer_sizes_are_refused(saved):
    directory, _ = saved
    model = build(seed=7, width=32)
    before = [np.asarray(v.value) for v in model.weights]
    with pytest.raises(ValueError, match=r"Variable 'd1/kernel' has shape \(16, 32\)"):
        keras_parallel.restore_checkpoint(model, directory)
    for variable, value in zip(model.weights, before, strict=True):
        np.testing.assert_array_equal(variable.value, value)


def test_other_layer_names_are_refused(saved):
    directory, _ = saved
    model = build(seed=7, head="out")
    with pytest.raises(ValueError, match=r"trainable_variables differ.*'out/bias'"):
        keras_parallel.restore_checkpoint(model, directory)


def test_uncompiled_model_restores_the_weights(saved):
    directory, state = saved
    keras.utils.set_random_seed(7)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(64, activation="relu", name="d1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="d2")(x))
    keras_parallel.restore_checkpoint(model, directory)
    for variable in model.weights:
        np.testing.assert_array_equal(variable.value, state[variable.path])


def test_another_optimizer_is_refused(saved):
    directory, _ = saved
    model = build(seed=7)
    model.compile(optimizer="sgd", loss="mse", distribution=model.distribution)
    with pytest.raises(ValueError, match=r"optimizer_variables differ.*same optimizer"):
        keras_parallel.restore_checkpoint(model, directory)


def test_missing_checkpoint_is_refused(saved, tmp_path):
    directory, _ = saved
    with pytest.raises(ValueError, match=r"No finished OrbaxCheckpoint"):
        keras_parallel.restore_checkpoint(build(), str(tmp_path))
    with pytest.raises(ValueError, match=r"No finished OrbaxCheckpoint of step 9"):
        keras_parallel.restore_checkpoint(build(), directory, step=9)


def test_each_process_writes_and_reads_its_own_shards(tmp_path):
    # 2 processes x 4 devices: saved on (1, 8), every kernel split over
    # devices of both processes; restored on (2, 4).
    from subprocesses import jax_launch_command, run_in_session

    command = jax_launch_command("orbax_processes_script.py", tmp_path)
    result = run_in_session(command, checkout_env(KERAS_BACKEND="jax"), 240)
    assert result.returncode == 0, result.stderr[-3000:]
    step_dir = tmp_path / "ckpt" / str(STEPS)
    # Each process wrote its own half of the split arrays, in its own files.
    written = []
    for process in (0, 1):
        files = (step_dir / "pytree" / f"ocdbt.process_{process}" / "d").iterdir()
        written.append(sum(f.stat().st_size for f in files))
    assert min(written) > 0.3 * sum(written), written
    weights = [np.load(tmp_path / f"weights{p}.npz") for p in (0, 1)]
    saved = [weights[0][f"saved{i}"] for i in range(4)]
    for process in (0, 1):
        for i in range(4):
            np.testing.assert_array_equal(weights[process][f"saved{i}"], saved[i])
            np.testing.assert_array_equal(weights[process][f"restored{i}"], saved[i])
        with open(tmp_path / f"info{process}.json") as f:
            info = json.load(f)
        assert info["step"] == info["iterations"] == STEPS
        assert info["mesh"] == [2, 4] and info["spec"] == ["None", "model"]
        # This process's 4 devices, a quarter of the 64 columns each.
        assert info["local_shards"] == [[16, 16]] * 4
    # And into one process, one device.
    model = build(None, seed=7, model_class=keras.Model)
    keras_parallel.restore_checkpoint(model, str(tmp_path / "ckpt"))
    for variable, value in zip(model.weights, saved, strict=True):
        np.testing.assert_array_equal(variable.value, value)
