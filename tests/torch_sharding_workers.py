"""Functions the torch `shard=` tests run in every rank (and in one).

Spawned processes import them by name, so they live outside the test module.
Every run trains `builders.wide_mlp` (or a deeper MLP of equal layers) with
Adam on `builders.wide_data`, at a global batch of 64, without shuffling;
with `distributed=False` the same model trains on one device in plain
Keras, from the same initial weights on the same batches. Results are plain
NumPy / Python values.
"""

import contextlib
import os
import re
import traceback

import numpy as np

from keras_parallel.keras_seam.model_state import binding_of

os.environ.setdefault("KERAS_BACKEND", "torch")

BATCH = 64
#: The variables large enough to shard (`shard_min_size` 4096), and their
#: Adam slots.
LARGE = ("d1/kernel", "d2/kernel")


def _model_class(distributed):
    import keras

    if not distributed:
        return keras.Model
    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    return Net


def deep_mlp(model_class, seed=5):
    """Four Dense layers of 256 -> 256 (65536 elements each, no bias): no
    one variable is most of the model, so a model made whole once exceeds
    its shards plus its largest variable."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((256,))
    x = inputs
    for i in range(4):
        x = keras.layers.Dense(256, use_bias=False, name=f"deep{i}")(x)
    return model_class(inputs=inputs, outputs=x, name="deep")


def _adam(accumulate=None):
    import keras

    return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accumulate)


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def _slot_name(path):
    # Keras numbers the optimizers of one process (`adam_3/...`).
    return re.sub(r"^adam_\d+/", "adam/", path)


def held(model):
    """`{path: (placements, local bytes, whole bytes)}` of the large kernels
    and of their Adam slots, read from each variable's own tensor."""
    from keras_parallel.backends.torch import dtensor_layouts

    out = {}
    for variable in list(model.variables) + list(model.optimizer.variables):
        path = _slot_name(variable.path)
        if not any(
            path == name or path.startswith(f"adam/{name.replace('/', '_')}_")
            for name in LARGE
        ):
            continue
        value = variable._value
        whole = value.numel() * value.element_size()  # DTensor: global size.
        placements = (
            [str(p) for p in value.placements]
            if dtensor_layouts.is_dtensor(value)
            else None
        )
        out[path] = (placements, dtensor_layouts.local_bytes(variable), whole)
    return out


@contextlib.contextmanager
def _recorded_gradients(model, record):
    """Records, at each Adam update, each large kernel's gradient as the
    update reads it: `(path, placements, local shape)`."""
    if not record:
        yield None
        return
    from torch.distributed.tensor import DTensor

    optimizer = model.optimizer
    update = optimizer._parallel_update_step
    seen = []

    def recording(grads, variables, learning_rate):
        for grad, variable in zip(grads, variables, strict=True):
            if variable.path in LARGE and isinstance(grad, DTensor):
                seen.append(
                    (
                        variable.path,
                        [str(p) for p in grad.placements],
                        tuple(grad.to_local().shape),
                    )
                )
        return update(grads, variables, learning_rate)

    optimizer._parallel_update_step = recording
    try:
        yield seen
    finally:
        del optimizer._parallel_update_step


def _model_parallel():
    import keras

    import keras_parallel

    devices = keras_parallel.DataParallel().device_mesh.devices.ravel().tolist()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def train(shard="full", steps=(1, 9), accumulate=None, distributed=True, builder=None):
    """Fits `wide_mlp` (with a probe) on consecutive batches, in parts.

    Args:
        shard: `shard=` of `keras_parallel.DataParallel`, or `None` (DDP),
            or `"model_parallel"`: a `(2, 2)` `ModelParallel` mesh, d1's
            kernel split over `model`, nothing sharded over the batch.
        steps: the steps of each `fit`, one after the other on the next
            batches; the weights after each part are returned.
        accumulate: Adam's `gradient_accumulation_steps`.
        distributed: False for one device (plain Keras).
        builder: a model builder, default `builders.wide_mlp`.

    Returns:
        `{"weights": [after each part], "split": probe records, "held",
        "gradients"}`; or `{"error": traceback}`.
    """
    import split_probe
    from builders import wide_data, wide_mlp

    import keras_parallel

    try:
        x, y = wide_data(BATCH * sum(steps))
        model = (builder or wide_mlp)(_model_class(distributed), probe=True)
        kwargs = {}
        if distributed and shard == "model_parallel":
            kwargs["distribution"] = _model_parallel()
        elif distributed:
            kwargs["distribution"] = keras_parallel.DataParallel(shard=shard)
        model.compile(optimizer=_adam(accumulate), loss="mse", **kwargs)
        model.optimizer.build(model.trainable_variables)
        out = {"weights": []}
        split_probe.clear()
        start = 0
        sharded = distributed and shard in ("full", "optimizer")
        with _recorded_gradients(model, sharded) as gradients:
            for part in steps:
                stop = start + part * BATCH
                model.fit(
                    x[start:stop],
                    y[start:stop],
                    batch_size=BATCH,
                    epochs=1,
                    shuffle=False,
                    verbose=0,
                )
                start = stop
                out["weights"].append(_weights(model))
        out["split"] = split_probe.records()
        out["gradients"] = gradients
        if sharded:
            out["held"] = held(model)
        return out
    except Exception:
        return {"error": traceback.format_exc()}


# ----------------------------------------------- DDP gradient accumulation
def ddp_accumulation(accumulate=4, updates=2):
    """DDP (`shard=None`) with Adam accumulating over `accumulate` steps.

    Counts the gradient buckets DDP all-reduces at each train step, through
    a comm hook that delegates to DDP's default all-reduce, installed on
    every DDP wrapper the executor makes.

    Returns:
        `train`'s result plus `"buckets"` (per step) and `"reduced_updates"`
        (the accumulators' all-reduces).
    """
    import keras
    import split_probe
    from builders import wide_data, wide_mlp
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        allreduce_hook,
    )

    import keras_parallel
    from keras_parallel.backends.torch.executor import TorchExecutor

    counter = [0]

    def counting(state, bucket):
        counter[0] += 1
        return allreduce_hook(state, bucket)

    make_ddp = TorchExecutor._make_ddp

    def make_counted_ddp(self, model):
        ddp = make_ddp(self, model)
        ddp.register_comm_hook(None, counting)
        return ddp

    class PerStep(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.buckets = []

        def on_train_batch_begin(self, batch, logs=None):
            self.before = counter[0]

        def on_train_batch_end(self, batch, logs=None):
            self.buckets.append(counter[0] - self.before)

    steps = accumulate * updates
    TorchExecutor._make_ddp = make_counted_ddp
    try:
        x, y = wide_data(BATCH * steps)
        model = wide_mlp(_model_class(True), probe=True)
        model.compile(
            optimizer=_adam(accumulate),
            loss="mse",
            distribution=keras_parallel.DataParallel(),
        )
        per_step = PerStep()
        split_probe.clear()
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[per_step],
        )
        steps_object = binding_of(model).executor._steps
        return {
            "weights": [_weights(model)],
            "split": split_probe.records(),
            "buckets": per_step.buckets,
            "reduced_updates": steps_object.accumulation.reduced_updates,
            "iterations": int(model.optimizer.iterations.numpy()),
        }
    except Exception:
        return {"error": traceback.format_exc()}
    finally:
        TorchExecutor._make_ddp = make_ddp


# ------------------------------------------------------ built in scope
def _variable_bytes(created):
    """The bytes the model's variables made so far hold (`deep*` layers)."""
    from keras_parallel.backends.torch import dtensor_layouts

    return sum(
        dtensor_layouts.local_bytes(v)
        for v in created
        if v._value is not None and v.path.startswith("deep")
    )


@contextlib.contextmanager
def _bytes_after_each_variable():
    """Records the bytes held by every variable made so far, after each is
    made (`Variable.__init__` returned): the variables' own tensors, their
    local shards where split."""
    from keras.src.backend.common.variables import Variable

    created = []
    trace = []
    init = Variable.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.append(self)
        trace.append(_variable_bytes(created))

    Variable.__init__ = recording_init
    try:
        yield created, trace
    finally:
        Variable.__init__ = init


def built_in_scope(in_scope, weights_file=None):
    """`deep_mlp` made inside (or outside) `DataParallel(shard="full").scope()`.

    Records the bytes held by variables after each one is made, through the
    build and `compile(distribution=...)`, then fits 1 step; with
    `weights_file`, first loads it (`load_weights`, written by one device).

    Returns:
        `{"trace", "after_compile", "bound", "weights", "loaded",
        "placements"}`, or `{"error": traceback}`.
    """
    from builders import wide_data

    import keras_parallel
    from keras_parallel.backends.torch import dtensor_layouts

    try:
        distribution = keras_parallel.DataParallel(shard="full")
        scope = distribution.scope() if in_scope else contextlib.nullcontext()
        with _bytes_after_each_variable() as (created, trace):
            with scope:
                model = deep_mlp(_model_class(True))
            placed_when_built = {
                v.path: [str(p) for p in v._value.placements]
                for v in model.weights
                if dtensor_layouts.is_dtensor(v._value)
            }
            model.compile(optimizer=_adam(), loss="mse", distribution=distribution)
            after_compile = _variable_bytes(created)
        plan = binding_of(model).plan
        model_entries = [e for e in plan.variables if e.kind == "model"]
        out = {
            "trace": trace,
            "after_compile": after_compile,
            "shards": sum(e.bytes_per_device for e in model_entries),
            "largest": max(e.bytes_total for e in model_entries),
            "whole": sum(e.bytes_total for e in model_entries),
            "placed_when_built": placed_when_built,
        }
        if weights_file is not None:
            model.load_weights(weights_file)
            out["loaded"] = _weights(model)
        x, _ = wide_data(BATCH)
        model.fit(x, x, batch_size=BATCH, verbose=0)  # An autoencoder.
        out["weights"] = _weights(model)
        return out
    except Exception:
        return {"error": traceback.format_exc()}


def deep_one_device(weights_file=None):
    """`deep_mlp` on one device: 1 step as `built_in_scope` fits it."""
    from builders import wide_data

    model = deep_mlp(_model_class(False))
    model.compile(optimizer=_adam(), loss="mse")
    if weights_file is not None:
        model.load_weights(weights_file)
    x, _ = wide_data(BATCH)
    model.fit(x, x, batch_size=BATCH, verbose=0)
    return _weights(model)


# -------------------------------------------------------- checkpoints
class _Interrupted(Exception):
    pass


def fit_with_backup(folder, interrupt):
    """Three shuffled epochs of `wide_mlp` (shard="full", Adam) with
    `BackupAndRestore` (a backup every epoch) and `ModelCheckpoint(
    save_weights_only=True)` in `folder`; with `interrupt`, every rank
    raises at the fifth batch of the second epoch.

    Returns:
        `(final weights, rows each step of this rank saw)`, or None when
        interrupted.
    """
    import keras
    import split_probe
    from builders import interrupt_at, wide_data, wide_mlp

    import keras_parallel

    x, y = wide_data(640)
    model = wide_mlp(_model_class(True), probe=True)
    split_probe.clear()
    model.compile(
        optimizer=_adam(),
        loss="mse",
        distribution=keras_parallel.DataParallel(shard="full"),
    )
    callbacks = [
        keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")),
        keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "checkpoint.weights.h5"), save_weights_only=True
        ),
    ]
    if interrupt:
        callbacks.append(interrupt_at(1, 4, _Interrupted()))
    try:
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=3,
            shuffle=True,
            verbose=0,
            callbacks=callbacks,
        )
    except _Interrupted:
        return None
    return _weights(model), split_probe.records()


def checkpoint_runs(folder):
    """An uninterrupted run, and one interrupted then run again (resumed)."""
    whole = os.path.join(folder, "uninterrupted")
    resumed = os.path.join(folder, "resumed")
    uninterrupted, _ = fit_with_backup(whole, interrupt=False)
    interrupted = fit_with_backup(resumed, interrupt=True)
    weights, split = fit_with_backup(resumed, interrupt=False)
    return {
        "uninterrupted": uninterrupted,
        "interrupted": interrupted,
        "resumed": weights,
        "resumed_split": split,
    }


def loaded_sharded(weights_file):
    """`wide_mlp` under `DataParallel(shard="full")` loading `weights_file`.

    Returns:
        `{"weights", "placements"}` after `load_weights`.
    """
    import keras
    from builders import wide_mlp

    import keras_parallel
    from keras_parallel.backends.torch import dtensor_layouts

    model = wide_mlp(_model_class(True), probe=True)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="mse",
        distribution=keras_parallel.DataParallel(shard="full"),
    )
    model.load_weights(weights_file)
    return {
        "weights": _weights(model),
        "placements": {
            v.path: [str(p) for p in v._value.placements]
            for v in model.weights
            if dtensor_layouts.is_dtensor(v._value)
        },
    }


# ------------------------------------------------------------ scenarios
def convnet(shard, steps=(1, 9), distributed=True, optimizer="adam"):
    """The guide's convnet on the guide's digits (Dropout off), in parts.

    Adam (default) or SGD with momentum (`optimizer="sgd"`: a slot per
    variable to shard too). Dropout is off so that one device's run is the
    reference. The rows each rank computed are read at the first
    convolution (this rank's shard of a DTensor batch).

    In float64: in float32 this model's trajectory is chaotic at the size
    of rounding. On one device alone, initial weights moved by a relative
    1e-7 (one float32 rounding) jump 4.5e-4 away at the sixth SGD step and
    reach 1.2e-2 by the tenth, for some moves and not others, so any other
    summation order (four ranks, another Keras release) may or may not hit
    it. In float64 the same experiment stays under 5e-7 at every step: the
    bound then tests the algorithm, not the luck of rounding.

    Returns:
        `{"weights": [[(path, array)] after each part], "rows": [rows per
        step], "held": {path: (local bytes, whole bytes)} of the kernels}`;
        or `{"error": traceback}`.
    """
    import keras

    import keras_parallel
    from keras_parallel import demo
    from keras_parallel.backends.torch import dtensor_layouts

    # Both: the global dtype policy, once read, no longer follows floatx.
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        keras.utils.set_random_seed(2)
        model = demo.get_model(_model_class(distributed))
        for layer in model.layers:
            if isinstance(layer, keras.layers.Dropout):
                layer.rate = 0.0
        first = next(la for la in model.layers if isinstance(la, keras.layers.Conv2D))
        rows = []
        call = first.call

        def counted(x, *args, **kwargs):
            local = x.to_local() if dtensor_layouts.is_dtensor(x) else x
            if local.device.type != "meta":
                rows.append(int(local.shape[0]))
            return call(x, *args, **kwargs)

        first.call = counted
        kwargs = {}
        if distributed:
            kwargs["distribution"] = keras_parallel.DataParallel(shard=shard)
        model.compile(
            optimizer=(
                keras.optimizers.Adam(1e-3)
                if optimizer == "adam"
                else keras.optimizers.SGD(0.05, momentum=0.9)
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **kwargs,
        )
        (x, y), _ = demo.load_digits_28()  # The guide's data: real digits.
        out = {"weights": []}
        start = 0
        for part in steps:
            stop = start + part * BATCH
            model.fit(
                x[start:stop], y[start:stop], batch_size=BATCH, shuffle=False, verbose=0
            )
            start = stop
            out["weights"].append(
                [
                    (v.path, np.asarray(w))
                    for v, w in zip(model.weights, model.get_weights(), strict=True)
                ]
            )
        out["rows"] = rows
        out["held"] = {
            v.path: (dtensor_layouts.local_bytes(v), v._value.numel() * 8)
            for v in model.trainable_variables
            if len(v.shape) > 1
        }
        return out
    except Exception:
        return {"error": traceback.format_exc()}
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def four_ranks(folder, deep_weights):
    """Every 4-process check of test_torch_sharding.py, in one launch."""
    out = {}
    for shard in ("full", "optimizer"):
        out[shard] = train(shard)
    for name in ("full", "optimizer", "model_parallel"):
        out[f"{name}_accumulated"] = train(name, steps=(8,), accumulate=4)
    out["ddp_accumulated"] = ddp_accumulation()
    out["built_in_scope"] = built_in_scope(True, deep_weights)
    out["built_outside_scope"] = built_in_scope(False)
    out["checkpoints"] = checkpoint_runs(folder)
    for shard in ("full", "optimizer"):
        out[f"{shard}_convnet"] = convnet(shard, optimizer="sgd")
        out[f"{shard}_convnet_adam"] = convnet(shard, steps=(1,))
    return out


# ------------------------------------------------------------ failure paths
def fail_while_sharded(where, failing_rank=1):
    """Raises on `failing_rank` under `DataParallel(shard="full")`.

    Args:
        where: `"fit"`: in a callback at the end of the fourth batch (with
            gradient accumulation, so micro-steps run too); `"build"`: while
            the model is made inside `distribution.scope()`, after its first
            variable was placed (a collective the others go on to).
    """
    import keras
    from builders import interrupt_at, wide_data, wide_mlp

    import keras_parallel

    rank = int(os.environ.get("RANK", "0"))
    distribution = keras_parallel.DataParallel(shard="full")
    error = ValueError(f"boom on rank {rank} while sharded ({where})")
    if where == "build":
        with distribution.scope():
            keras.layers.Dense(512, name="first").build((None, 256))
            if rank == failing_rank:
                raise error
            model = wide_mlp(_model_class(True))
        return None
    model = wide_mlp(_model_class(True))
    model.compile(optimizer=_adam(2), loss="mse", distribution=distribution)
    x, y = wide_data(640)
    # Every rank runs the same callbacks (they decide which logs are made
    # global at each step, a collective); only one raises.
    at = (0, 3) if rank == failing_rank else (-1, -1)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[interrupt_at(*at, error)])
    return None
