"""Functions the torch ModelParallel tests run in every rank (and in one).

Spawned processes import them by name, so they live outside the test module.
Each case trains one model with `model.fit` under a `ModelParallel` over a
2D mesh `("data", "model")` of the 4 processes, or, with
`distributed=False`, the same model on one device in plain Keras, from the
same initial weights on the same global batches. Results are plain NumPy /
Python values.
"""

import contextlib
import os

import numpy as np

from keras_parallel.keras_seam.model_state import binding_of

os.environ.setdefault("KERAS_BACKEND", "torch")

AXES = ("data", "model")
#: KerasHub backbones (`hub_models`), trained with `rules="auto"`: one of
#: each attention layout (Mistral's and Qwen's attention have Llama's
#: equations, with a sliding window and with biases; all six train on JAX,
#: tests/test_jax_derived_layouts.py).
HUB_FAMILIES = ("llama", "gemma", "gpt2", "bert")


def _keras():
    import keras

    return keras


def _model_class(distributed):
    keras = _keras()
    if not distributed:
        return keras.Model
    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    return Net


# ------------------------------------------------------------------ models
def mlp(model_class, batchnorm=False):
    """The guide's MLP: d1 (16 -> 32), optional BatchNorm, d2 (32 -> 8)."""
    from builders import dense_model

    return dense_model(model_class, batchnorm=batchnorm)


def mlp_layouts(layout_map):
    """`d1/kernel` split over `model` (columns), `d2`'s rows, d2's output.

    d2's output is split by its columns over `model` too: a placement no
    layer output gets without its key (by default partial sums are finished
    and the batch split along `data` only), so an ignored key would show.
    """
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/kernel"] = ("model", None)
    layout_map["d2/output"] = ("data", "model")


def megatron(model_class):
    """The benchmark's MLP, small: d1 (16 -> 64), d2 (64 -> 64), d3 (64 -> 16)."""
    keras = _keras()
    keras.utils.set_random_seed(3)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(64, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(64, activation="relu", name="d2")(x)
    outputs = keras.layers.Dense(16, name="d3")(x)
    return model_class(inputs=inputs, outputs=outputs, name="megatron")


def megatron_layouts(layout_map):
    """Split as Megatron-LM does: columns, rows, columns; no output key."""
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/kernel"] = ("model", None)
    layout_map["d3/kernel"] = (None, "model")
    layout_map["d3/bias"] = ("model",)


def convnet(model_class):
    """The guide's convnet (demo.get_model), without its Dropout.

    Dropout's masks are drawn per process under DDP (mesh `(4, 1)`), so they
    would differ from one device's; the rate is set to 0 to compare.
    """
    keras = _keras()
    from keras_parallel import demo

    keras.utils.set_random_seed(2)
    model = demo.get_model(model_class)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def convnet_layouts(layout_map, model):
    """The convnet's two dense kernels split over `model`."""
    keras = _keras()
    hidden, logits = [la for la in model.layers if isinstance(la, keras.layers.Dense)]
    layout_map[f"{hidden.name}/kernel"] = (None, "model")
    layout_map[f"{hidden.name}/bias"] = ("model",)
    layout_map[f"{logits.name}/kernel"] = ("model", None)


VOCAB, SEQ, HIDDEN, HEADS, FFW = 48, 8, 16, 4, 32


def transformer(model_class):
    """A KerasHub-style decoder block: embedding, attention, gated MLP."""
    keras = _keras()
    keras.utils.set_random_seed(4)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="token_embedding")(tokens)
    h = keras.layers.LayerNormalization(name="pre_attention_norm")(x)
    attention = keras.layers.MultiHeadAttention(
        num_heads=HEADS, key_dim=HIDDEN // HEADS, name="attention"
    )
    x = x + attention(h, h)
    h = keras.layers.LayerNormalization(name="pre_ffw_norm")(x)
    h = keras.layers.Dense(FFW, activation="gelu", name="ffw_gating")(h)
    x = x + keras.layers.Dense(HIDDEN, name="ffw_linear")(h)
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(VOCAB, name="logits")(x)
    return model_class(inputs=tokens, outputs=logits, name="block")


def transformer_layouts(layout_map):
    """As KerasHub's `get_layout_map`: weights over both `model` and `data`."""
    layout_map["token_embedding/embeddings"] = ("model", "data")
    layout_map["attention/(query|key|value)/kernel"] = ("data", "model", None)
    layout_map["attention/attention_output/kernel"] = ("model", None, "data")
    layout_map["ffw_gating/kernel"] = ("data", "model")
    layout_map["ffw_linear/kernel"] = ("model", "data")


# -------------------------------------------------------------------- data
def data(kind, n):
    rng = np.random.default_rng(0)
    if kind in ("mlp", "megatron"):
        return (
            rng.normal(size=(n, 16)).astype("float32"),
            rng.normal(size=(n, 8 if kind == "mlp" else 16)).astype("float32"),
        )
    if kind == "convnet":
        from keras_parallel import demo

        (x, y), _ = demo.load_digits_28()  # The guide's data: real digits.
        return x[:n], y[:n]
    if kind in HUB_FAMILIES:
        import hub_models

        return hub_models.batch(kind, n)
    x = rng.integers(0, VOCAB, size=(n, SEQ)).astype("int32")
    return x, x[:, 0].copy()  # Learnable: the first token.


# -------------------------------------------------------------------- runs
def distribution(kind, mesh_shape, model, rules=None, shard=None):
    keras = _keras()
    import keras_parallel

    devices = keras_parallel.DataParallel().device_mesh.devices.ravel().tolist()
    mesh = keras.distribution.DeviceMesh(mesh_shape, list(AXES), devices)
    if rules is not None:  # No LayoutMap: layouts derived from the layers.
        return keras_parallel.ModelParallel(
            device_mesh=mesh,
            rules=rules,
            batch_dim_name="data",
            shard=shard,
            shard_min_size=1,  # The test models' variables are all small.
        )
    layout_map = keras.distribution.LayoutMap(mesh)
    if kind == "mlp":
        mlp_layouts(layout_map)
    elif kind == "megatron":
        megatron_layouts(layout_map)
    elif kind == "convnet":
        convnet_layouts(layout_map, model)
    else:
        transformer_layouts(layout_map)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"
    )


def build(kind, distributed, batchnorm=False):
    model_class = _model_class(distributed)
    if kind == "mlp":
        return mlp(model_class, batchnorm=batchnorm)
    if kind == "megatron":
        return megatron(model_class)
    if kind == "convnet":
        return convnet(model_class)
    if kind in HUB_FAMILIES:
        import hub_models

        return hub_models.model(kind, probe=True, model_class=model_class)
    return transformer(model_class)


def train(
    kind="mlp",
    mesh=(2, 2),
    steps=1,
    n=64,
    batchnorm=False,
    distributed=True,
    evaluate=False,
    save_to=None,
    inspect=False,
    rules=None,
    in_scope=False,
    shard=None,
):
    """Trains one case; returns weights, logs and (distributed) what it held.

    Args:
        kind: `"mlp"`, `"megatron"`, `"convnet"` or `"transformer"`.
        mesh: the `(data, model)` mesh shape.
        steps: `steps_per_epoch`, or None for one whole epoch.
        n: the number of samples (1003 at batch 64: a last batch of 43).
        evaluate: also evaluate on every sample and predict 203 of them.
        save_to: a folder to `model.save` the trained model to.
        inspect: also return the bytes this process holds and placements.
        rules: `ModelParallel(rules=...)` instead of the kind's LayoutMap
            (through the `ShardingCallback` door); also return the rows
            this process computed and where each split variable lives.
        in_scope: with `rules`, build the model inside the distribution's
            scope; also return where each variable was placed as made.
        shard: with `rules`, `shard=` of the `ModelParallel`.
    """
    keras = _keras()
    import split_probe

    import keras_parallel

    x, y = data(kind, n)
    made, kwargs = None, {}
    if distributed and in_scope:
        # Built inside the scope: each variable placed as it is made. On
        # torch such a model takes the compile door: Keras runs a model
        # before a `fit`'s callbacks are set (its symbolic build), and
        # its split variables need the distribution entered.
        by_rules = distribution(kind, mesh, None, rules)
        with by_rules.scope():
            model = build(kind, True, batchnorm)
        made = _placements(model.variables)
        kwargs = {"distribution": by_rules}
    else:
        # The ShardingCallback door (rules) trains a plain keras.Model.
        model = build(kind, distributed and rules is None, batchnorm)
    mse = kind in ("mlp", "megatron", *HUB_FAMILIES)
    loss = "mse" if mse else keras.losses.SparseCategoricalCrossentropy(True)
    callbacks = []
    if distributed and rules is not None and made is None:
        callbacks = [
            keras_parallel.ShardingCallback(
                distribution(kind, mesh, model, rules, shard)
            )
        ]
    elif distributed and made is None:
        kwargs["distribution"] = distribution(kind, mesh, model)
    split_probe.clear()
    # The variables are placed (their gradient hooks registered) by
    # `compile`, or by `fit` where a plan places them again.
    with _arriving_gradients(inspect and distributed) as arriving:
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=loss,
            **kwargs,
        )
        history = model.fit(
            x,
            y,
            batch_size=64,
            epochs=1,
            steps_per_epoch=steps,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    result = {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
        "rank": int(os.environ.get("RANK", "0")),
    }
    if evaluate:
        result["evaluation"] = float(model.evaluate(x, y, batch_size=64, verbose=0))
        result["predictions"] = np.asarray(
            model.predict(x[:203], batch_size=64, verbose=0)
        )
    if save_to is not None:
        model.save(os.path.join(save_to, f"{kind}.keras"))
    if inspect and distributed:
        result["arriving_gradients"] = arriving
    if distributed and rules is not None:
        result["split"] = split_probe.records()
        result["placements"] = _placements(model.variables)
        result["made"] = made
    if inspect and distributed and kind == "mlp":
        result.update(_held(model))
        result["describe"] = keras_parallel.describe(model)
    return result


@contextlib.contextmanager
def _arriving_gradients(record):
    """Records each split variable's gradient as the backward pass made it:
    `(global shape, the shape this process computed)`, before it is
    redistributed to the variable's placements. Patched before `compile`,
    which registers the hook on each placed variable."""
    arriving = []
    if not record:
        yield arriving
        return
    from keras_parallel.backends.torch import dtensor_layouts

    original = dtensor_layouts.placed_gradient

    def recording(grad, mesh, placements):
        if dtensor_layouts.is_dtensor(grad) and any(p.is_shard() for p in placements):
            arriving.append((tuple(grad.shape), tuple(grad.to_local().shape)))
        return original(grad, mesh, placements)

    dtensor_layouts.placed_gradient = recording
    try:
        yield arriving
    finally:
        dtensor_layouts.placed_gradient = original


def _held(model):
    """The bytes this process holds, where the split variables live, and the
    placements of d2's output (constrained by `d2/output`)."""
    from keras_parallel.backends.torch import dtensor_layouts

    variables = list(model.variables) + list(model.optimizer.variables)
    plan = binding_of(model).plan
    return {
        "d2_output": _d2_output_placements(model),
        "plan_outputs": [(o.key, o.path, tuple(o.axes)) for o in plan.outputs],
        "held_bytes": sum(dtensor_layouts.local_bytes(v) for v in variables),
        "plan_bytes": plan.bytes_per_device(),
        "total_bytes": plan.bytes_total(),
        "placements": _placements(variables),
    }


def _placements(variables):
    """`{path: (placements, local shape)}` of each DTensor variable."""
    import re

    from keras_parallel.backends.torch import dtensor_layouts

    placements = {}
    for variable in variables:
        value = variable._value
        if dtensor_layouts.is_dtensor(value):
            path = re.sub(r"^sgd_\d+/", "sgd/", variable.path)
            placements[path] = (
                [str(p) for p in value.placements],
                tuple(value.to_local().shape),
            )
    return placements


def _d2_output_placements(model):
    """d2 called, as in a step, on d1's output split by rows and columns.

    Unconstrained, its output would be a partial sum over `model`
    (`Partial(sum)`), which the default finishes (`Replicate()`);
    `d2/output = ("data", "model")` splits its columns (`Shard(1)`).
    """
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from keras_parallel.backends.torch.step_metrics import StepRows
    from keras_parallel.run.run import Run

    binding = binding_of(model)
    steps = binding.executor._steps
    if not hasattr(steps, "mesh"):
        return None  # A mesh (4, 1) runs on DDP: no DTensors.
    with Run(binding, model):
        steps.step_rows = StepRows(4, 0, 4, False)
        hidden = torch.ones((4, 32 // steps.mesh.size(1)))
        split = DTensor.from_local(hidden, steps.mesh, (Shard(0), Shard(1)))
        return [str(p) for p in model.get_layer("d2")(split).placements]


def plan_table(kind, mesh):
    """The describe() table (variables and outputs) planned in one process."""
    keras = _keras()
    from keras_parallel.plan.sharding_plan import resolve_plan
    from keras_parallel.report import format_plan

    x, y = data(kind, 64)
    model = build(kind, False)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    names = [f"cpu:{i}" for i in range(4)]
    model_mesh = keras.distribution.DeviceMesh(mesh, list(AXES), names)
    layout_map = keras.distribution.LayoutMap(model_mesh)
    mlp_layouts(layout_map)
    planned = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"
    )
    plan = resolve_plan(planned, model, device_names=names)
    return table_of(format_plan(plan, model.name))


def table_of(text):
    """The rows of a describe() text from its table header on, as cells.

    Keras numbers the optimizers of one process (`sgd_3/...`): the names
    are made one, and the cells compared, not the padding.
    """
    import re

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Variable"))
    return [re.sub(r"\bsgd_\d+/", "sgd/", line).split() for line in lines[start:]]


def bad_inputs():
    """Each bad distribution's error text, or "no error"."""
    keras = _keras()
    import keras_parallel

    devices = [f"cpu:{i}" for i in range(8)]
    split = {"d1/kernel": (None, "model")}
    cases = {
        "fewer processes": ((2, 4), devices, split, mlp),
        "more processes": ((1, 2), devices[:2], split, mlp),
        "rank": ((2, 2), devices[:4], {"d1/kernel": ("model", None, None)}, mlp),
        "two keys": (
            (2, 2),
            devices[:4],
            {"d1/ker.*": split["d1/kernel"], "d1/k.*": split["d1/kernel"]},
            mlp,
        ),
        "indivisible": ((1, 4), devices[:4], {"d2/kernel": (None, "model")}, _six_out),
    }
    out = {}
    for name, (shape, names, layouts, builder) in cases.items():
        mesh = keras.distribution.DeviceMesh(shape, list(AXES), names)
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in layouts.items():
            layout_map[key] = axes
        model = builder(_model_class(True))
        try:
            model.compile(
                optimizer="sgd",
                loss="mse",
                distribution=keras.distribution.ModelParallel(
                    layout_map=layout_map, batch_dim_name="data"
                ),
            )
            out[name] = "no error"
        except keras_parallel.ShardingError as error:
            out[name] = str(error)
    return out


def _six_out(model_class):
    """d2 has 6 outputs: not divisible by a model axis of 4."""
    keras = _keras()
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="d1")(inputs)
    return model_class(inputs=inputs, outputs=keras.layers.Dense(6, name="d2")(x))


class _Interrupted(Exception):
    pass


def _fit_with_backup(mesh, folder, interrupt):
    """Three shuffled epochs of the MLP with `BackupAndRestore` (a backup
    every epoch) and `ModelCheckpoint` in `folder`; with `interrupt`, every
    rank raises at the fifth batch of the second epoch. Returns the final
    weights, or None when interrupted."""
    from builders import interrupt_at

    keras = _keras()

    x, y = data("mlp", 640)
    model = build("mlp", True)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss="mse",
        distribution=distribution("mlp", mesh, model),
    )
    callbacks = [
        keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")),
        keras.callbacks.ModelCheckpoint(os.path.join(folder, "checkpoint.keras")),
    ]
    if interrupt:
        callbacks.append(interrupt_at(1, 4, _Interrupted()))
    try:
        model.fit(
            x, y, batch_size=64, epochs=3, shuffle=True, verbose=0, callbacks=callbacks
        )
    except _Interrupted:
        return None
    return [np.asarray(w) for w in model.get_weights()]


def checkpoint_runs(folder, mesh=(2, 2)):
    """An uninterrupted run, and one interrupted then run again (resumed).

    Returns:
        `{"uninterrupted": weights, "interrupted": None, "resumed":
        weights}`; the files are in `folder/{uninterrupted,resumed}`.
    """
    whole = os.path.join(folder, "uninterrupted")
    resumed = os.path.join(folder, "resumed")
    return {
        "uninterrupted": _fit_with_backup(mesh, whole, interrupt=False),
        "interrupted": _fit_with_backup(mesh, resumed, interrupt=True),
        "resumed": _fit_with_backup(mesh, resumed, interrupt=False),
    }


def jax_written(n=1003):
    """The ModelParallel script of docs/jax.md, as written for JAX, on 4 ranks.

    The devices come from `keras.distribution.list_devices()` before any
    other keras_parallel code ran in this process (run it first): Keras 3.15
    has no torch `distribution_lib`, and keras_parallel gives it one when
    Keras is imported. The model, data and layouts are `train`'s
    `mlp_epoch_2x2` case, so one device's weights are the same reference.

    Returns:
        `{"split", "devices", "weights", "loss", "evaluation",
        "predictions"}` (`split`: the probe's records of `fit`), or
        `{"error": traceback}` where the script failed (every rank fails
        alike, before any collective).
    """
    import traceback

    keras = _keras()
    try:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh((2, 2), ["data", "model"], devices=devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        mlp_layouts(layout_map)
        x, y = data("mlp", n)
        # `mlp` with a probe after the Input (no variables: the same weights)
        # recording the rows of each step's batch this rank held.
        import split_probe
        from builders import dense_model

        model = dense_model(_model_class(True), probe=True)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss="mse",
            distribution=keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="data"
            ),
        )
        split_probe.clear()
        history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        split = split_probe.records()
    except Exception:
        return {"error": traceback.format_exc()}
    return {
        "split": split,
        "devices": list(devices),
        "weights": [np.asarray(w) for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
        "evaluation": float(model.evaluate(x, y, batch_size=64, verbose=0)),
        "predictions": np.asarray(model.predict(x[:203], batch_size=64, verbose=0)),
    }


def _whole_values(model):
    """Each weight's whole value, gathered (`full_tensor()`, a collective)
    from the variable's tensor: not through `Variable.numpy()`."""
    from keras_parallel.backends.torch import dtensor_layouts

    return [
        dtensor_layouts.whole_value(v._value).detach().cpu().numpy().copy()
        for v in model.weights
    ]


def _split_weights(model):
    """`{path: placements}` of the model's weights that are DTensors."""
    from keras_parallel.backends.torch import dtensor_layouts

    return {
        v.path: [str(p) for p in v._value.placements]
        for v in model.weights
        if dtensor_layouts.is_dtensor(v._value)
    }


def weights_after_callback_fit(folder, mesh=(2, 2)):
    """The MLP of `mlp_ten_steps_2x2` fit through the callback door, then
    its weights read and written through Keras's own methods, every rank.

    A plain `keras.Model` is fit with `callbacks=[ShardingCallback(...)]`;
    its split variables stay DTensors after `fit`. Then, on every rank:
    `get_weights()` of the model and of `d1`; `set_weights` of the whole
    values doubled; `save_weights` to `folder/after_fit.weights.h5` and
    `save` to `folder/after_fit.keras` (rank 0 writes), a barrier, `set_weights` of the trained values again, and
    `load_weights` of the file.

    Returns:
        `{"split", "whole", "weights", "d1", "set", "set_whole", "loaded",
        "loaded_whole", "still_split"}` (`*whole`: gathered from the
        variables' tensors, `_whole_values`), or with `"error"` (a
        traceback) where a step failed: every rank fails alike, where the
        variables are read or assigned, before any collective of that step.
    """
    import traceback

    keras = _keras()
    import torch.distributed as dist

    import keras_parallel

    x, y = data("mlp", 640)
    model = build("mlp", False)  # Plain Keras: only the callback distributes.
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    callback = keras_parallel.ShardingCallback(distribution("mlp", mesh, model))
    out = {}
    try:
        model.fit(
            x,
            y,
            batch_size=64,
            epochs=1,
            steps_per_epoch=10,
            shuffle=False,
            verbose=0,
            callbacks=[callback],
        )
        out["split"] = _split_weights(model)
        out["whole"] = _whole_values(model)
        out["weights"] = [np.asarray(w) for w in model.get_weights()]
        out["d1"] = [np.asarray(w) for w in model.get_layer("d1").get_weights()]
        model.set_weights([2 * w for w in out["whole"]])
        out["set"] = [np.asarray(w) for w in model.get_weights()]
        out["set_whole"] = _whole_values(model)
        path = os.path.join(folder, "after_fit.weights.h5")
        model.save_weights(path)
        model.save(os.path.join(folder, "after_fit.keras"))
        dist.barrier()  # Rank 0 wrote the files.
        model.set_weights(out["whole"])
        model.load_weights(path)
        out["loaded"] = [np.asarray(w) for w in model.get_weights()]
        out["loaded_whole"] = _whole_values(model)
        out["still_split"] = _split_weights(model)
    except Exception:
        out["error"] = traceback.format_exc()
    return out


def scenarios(
    cases,
    with_errors=False,
    checkpoint_dir=None,
    with_jax_written=False,
    after_fit_dir=None,
):
    """Runs `train(**case)` for each case in this process; returns the list
    (then the `bad_inputs()` texts, then the `checkpoint_runs`, then
    `jax_written()`, which runs first: before anything else in the process,
    then `weights_after_callback_fit(after_fit_dir)`)."""
    first = jax_written() if with_jax_written else None
    results = [train(**case) for case in cases]
    if with_errors:
        results.append(bad_inputs())
    if checkpoint_dir is not None:
        results.append(checkpoint_runs(checkpoint_dir))
    if with_jax_written:
        results.append(first)
    if after_fit_dir is not None:
        results.append(weights_after_callback_fit(after_fit_dir))
    return results
