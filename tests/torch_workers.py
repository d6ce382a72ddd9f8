"""Functions the torch multi-process tests run in every rank.

They live in their own module (not a test module) so that `spawn`ed
processes can import them by name without collecting tests. Each returns
plain NumPy / Python values for the parent to compare.
"""

import os

import numpy as np
import split_probe

os.environ.setdefault("KERAS_BACKEND", "torch")


def _keras():
    import keras

    return keras


def make_data(n=1003, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


def make_model(distributed=True, batchnorm=False, seed=3, classes=3, features=6):
    """A small model without dropout; optionally a DistributedModel.

    A `split_probe.probe()` follows the Input (no variables: the weights
    are those of the model without it), recording the rows each step of
    this rank computed.
    """
    keras = _keras()
    import keras_parallel

    base = keras.Model
    if distributed:

        class Net(keras_parallel.DistributedModel, keras.Model):
            pass

        base = Net
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    x = split_probe.probe()(inputs)
    x = keras.layers.Dense(16, activation="tanh")(x)
    if batchnorm:
        x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(classes)(x)
    return base(inputs=inputs, outputs=outputs)


def _row_count():
    """A metric that sums, not averages: rows counted twice would show."""
    keras = _keras()

    class RowCount(keras.metrics.Metric):
        def __init__(self, name="row_count", **kwargs):
            super().__init__(name=name, **kwargs)
            self.rows = self.add_variable((), initializer="zeros", name="rows")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.rows.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

        def result(self):
            # A new tensor, not the variable: JAX cannot trace a variable,
            # and TensorFlow's `convert_to_tensor` returns the variable
            # itself, which History would read after validation reset it
            # (one device), or one worker's part of (several workers).
            return self.rows + 0.0

    return RowCount()


def _compile(model, distribution=None, lr=0.1):
    keras = _keras()
    kwargs = {} if distribution is None else {"distribution": distribution}
    model.compile(
        optimizer=keras.optimizers.SGD(lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", _row_count()],
        **kwargs,
    )


def weights_of(model):
    return [np.array(v.numpy()) for v in model.weights]


def train(
    door="mixin",
    steps=None,
    epochs=1,
    n=1003,
    batch_size=64,
    batchnorm=False,
    sync_batchnorm=False,
    shuffle=False,
    distributed=True,
    with_validation=False,
    data_kind="numpy",
    record_step_logs=False,
    decide_on_plateau=False,
    seed_by_rank=False,
):
    """Fits the small model; returns weights, history and rank info.

    Also the rows this rank's train steps computed (`"split"`: the
    `split_probe.records()` of fit; evaluate and predict run after it
    without the callback of the "callback" door, whole on every rank).

    Args:
        door: "mixin" (DistributedModel) or "callback" (ShardingCallback).
        steps: steps_per_epoch, or None for whole epochs.
        distributed: False trains the same model in plain Keras.
        seed_by_rank: each rank builds its model from another seed (rank 0
            from the usual one): only the initial broadcast makes them agree.
    """
    _keras()
    import keras_parallel

    x, y = make_data(n)
    callbacks = []
    rank = int(os.environ.get("RANK", "0"))
    model = make_model(
        distributed=distributed and door == "mixin",
        batchnorm=batchnorm,
        seed=3 + (rank if seed_by_rank else 0),
    )
    distribution = None
    if distributed:
        distribution = keras_parallel.DataParallel(sync_batchnorm=sync_batchnorm)
    step_logs = []
    if record_step_logs:
        # A callback that reads every step's logs: they must be global.
        keras = _keras()

        class StepLogs(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                step_logs.append({k: float(v) for k, v in logs.items()})

        callbacks.append(StepLogs())
    if decide_on_plateau:
        # Decisions from epoch logs: the same on every rank, and the same as
        # in one process, only if the logs are global.
        keras = _keras()
        callbacks += [
            keras.callbacks.ReduceLROnPlateau(
                monitor="val_loss", factor=0.5, patience=0, min_delta=5e-3
            ),
            keras.callbacks.EarlyStopping(
                monitor="val_loss", patience=1, min_delta=5e-3
            ),
        ]
    if door == "mixin":
        _compile(model, distribution)
    else:
        _compile(model)
        if distribution is not None:
            callbacks.append(keras_parallel.ShardingCallback(distribution))
    classes = {}
    keras = _keras()

    class RecordClass(keras.callbacks.Callback):
        # The model's class while `fit` runs: its own, behind the trainer.
        def on_train_batch_end(self, batch, logs=None):
            model = self.model
            classes.setdefault("during_fit", _class_of(model))

    callbacks.append(RecordClass())
    data = {"x": x, "y": y}
    if data_kind == "dataloader":
        import torch

        dataset = torch.utils.data.TensorDataset(
            torch.from_numpy(x), torch.from_numpy(y)
        )
        data = {"x": torch.utils.data.DataLoader(dataset, batch_size=batch_size)}
    elif data_kind == "tf_data":
        import tensorflow as tf

        data = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)}
    elif data_kind == "pydataset":
        data = {"x": _ArraySequence(x, y, batch_size)}
    # Keras shuffles arrays only; asked to shuffle a loader, it warns.
    fit_kwargs = {"shuffle": shuffle and data_kind == "numpy"}
    if data_kind == "numpy":
        fit_kwargs["batch_size"] = batch_size
    if with_validation:
        fit_kwargs["validation_data"] = (x[:301], y[:301])
    split_probe.clear()
    history = model.fit(
        **data,
        epochs=epochs,
        steps_per_epoch=steps,
        verbose=0,
        callbacks=callbacks,
        **fit_kwargs,
    )
    split = split_probe.records()
    evaluation = model.evaluate(
        x, y, batch_size=batch_size, verbose=0, return_dict=True
    )
    predictions = model.predict(x[:203], batch_size=batch_size, verbose=0)
    return {
        "weights": weights_of(model),
        "history": {k: list(map(float, v)) for k, v in history.history.items()},
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "predictions": np.asarray(predictions),
        "step_logs": step_logs,
        "rank": int(os.environ.get("RANK", "0")),
        "split": split,
        # The entry points put the trainer's methods on the model; taken
        # off after each.
        "class_during_fit": classes["during_fit"],
        "class_after": _class_of(model),
    }


def _class_of(model):
    """`(type(model)'s name, whether model.__class__ is type(model), the
    overrides in force on the model, the newest first)`."""
    from keras_parallel.keras_seam.overrides import in_force

    honest = model.__class__ is type(model)
    return type(model).__name__, honest, [type(o).__name__ for o in in_force(model)]


class _ArraySequence:
    """A `keras.utils.PyDataset` over arrays, made lazily (keras import)."""

    def __new__(cls, x, y, batch_size):
        keras = _keras()

        class Sequence(keras.utils.PyDataset):
            def __init__(self):
                super().__init__()

            def __len__(self):
                return -(-len(x) // batch_size)

            def __getitem__(self, i):
                s = slice(i * batch_size, (i + 1) * batch_size)
                return x[s], y[s]

        return Sequence()


def count_samples(epochs=2, n=1003, batch_size=64, shuffle=True):
    """Trains on sample ids and counts, per rank, the ids each step saw."""
    keras = _keras()
    import keras_parallel

    x, y = make_data(n)
    ids = np.arange(n, dtype="float32")
    seen = []

    class Counting(keras_parallel.DistributedModel, keras.Model):
        def train_step(self, data):
            (x_batch, id_batch), _ = data[0], data[1]
            seen.append(np.asarray(id_batch.detach().cpu().numpy()).astype(int).ravel())
            return super().train_step(((x_batch, id_batch), data[1]))

    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    id_input = keras.Input((1,))
    hidden = keras.layers.Dense(4)(inputs)
    outputs = keras.layers.Dense(3)(
        keras.layers.Concatenate()([hidden, id_input * 0.0])
    )
    model = Counting(inputs=[inputs, id_input], outputs=outputs)
    _compile(model, keras_parallel.DataParallel())
    model.fit(
        (x, ids[:, None]),
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=shuffle,
        verbose=0,
    )
    return [s.tolist() for s in seen]


def fail_at(step=3, failing_rank=1, where="step", batchnorm=False):
    """Trains, and rank `failing_rank` raises at train step `step`.

    Args:
        where: `"step"` raises inside the train step; `"callback"` raises
            in a callback's `on_train_batch_end`, outside any step.
        batchnorm: a model with BatchNorm, whose moving statistics the
            executor synchronises when an entry point ends normally.
    """
    keras = _keras()
    import keras_parallel

    rank = int(os.environ.get("RANK", "0"))
    x, y = make_data(640)

    class Failing(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if where == "callback" and rank == failing_rank and batch == step:
                raise ValueError(f"boom on rank {rank} at batch {batch}")

    model = make_model(distributed=True, batchnorm=batchnorm)
    _compile(model, keras_parallel.DataParallel())
    original = model.train_step

    calls = {"n": 0}

    def train_step(data):
        calls["n"] += 1
        if where == "step" and rank == failing_rank and calls["n"] == step:
            raise ValueError(f"boom on rank {rank} at step {step}")
        return original(data)

    object.__setattr__(model, "train_step", train_step)
    model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[Failing()])
    return "finished"


def dropout_masks(seed=None, rows=64):
    """The dropout mask each rank draws in its first train step (`seed`: the
    layer's own, a seed generator variable of the model)."""
    keras = _keras()
    import keras_parallel

    masks = []

    class RecordingDropout(keras.layers.Dropout):
        def call(self, inputs, training=False):
            outputs = super().call(inputs, training=training)
            if training:
                masks.append((outputs.detach().cpu().numpy() != 0).astype("int8"))
            return outputs

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    keras.utils.set_random_seed(3)
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(2)(RecordingDropout(0.5, seed=seed)(inputs))
    model = Net(inputs=inputs, outputs=outputs)
    _compile(model, keras_parallel.DataParallel())
    x = np.ones((rows, 16), "float32")
    y = np.zeros((rows,), "int32")
    model.fit(x, y, batch_size=rows, epochs=1, verbose=0)
    return masks[0]


def digits_accuracy(epochs=12, batch_size=32):
    """The demo's convnet on digits; returns the test accuracy."""
    from keras_parallel import demo

    return demo.run(epochs=epochs, batch_size=batch_size, verbose=0)


def rank_info():
    import keras_parallel
    from keras_parallel.backends import executor_class

    devices = keras_parallel.DataParallel().device_mesh.devices.tolist()
    executor = executor_class()(keras_parallel.DataParallel())
    return {
        "devices": devices,
        "rank": executor.process_index,
        "world": executor.num_processes,
        "sum": executor.reduce(float(executor.process_index + 1), op="sum"),
        "mean": executor.reduce(float(executor.process_index + 1)),
        "broadcast": executor.broadcast(f"from {executor.process_index}"),
    }


def scenarios(cases):
    """Runs `train(**case)` for each case in one process; returns the list."""
    return [train(**case) for case in cases]


def uneven_data(batch_size=64):
    """Rank 1 is given 3 fewer samples than rank 0: must fail, not hang."""
    keras = _keras()
    import keras_parallel

    rank = int(os.environ.get("RANK", "0"))
    x, y = make_data(1003 - 3 * rank)
    model = make_model()
    _compile(model, keras_parallel.DataParallel())
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    return keras.__version__


def different_data(cases, rows_by_rank=(1003, 900)):
    """Runs each `(door, kind)` on `rows_by_rank[rank]` rows; then one fit.

    Each case must raise the same `ValueError` on every rank before any
    collective can disagree; a rank that ran a collective while that error
    unwound would leave the final fit (on equal data) mismatched or hung.

    Args:
        cases: `(door, kind)` pairs: door `"mixin"` or `"callback"`, kind
            `"fit"`, `"evaluate"` or `"predict"`; all with `verbose=0`.
        rows_by_rank: the rows each rank is given.

    Returns:
        `(messages, history)`: each case's error message, or `None` where it
        did not raise, and the final fit's loss history.
    """
    import keras_parallel

    rank = int(os.environ.get("RANK", "0"))
    x, y = make_data(rows_by_rank[rank])
    messages = []
    for door, kind in cases:
        callbacks = []
        if door == "callback":
            model = make_model(distributed=False)
            _compile(model)
            callbacks = [keras_parallel.ShardingCallback(keras_parallel.DataParallel())]
        else:
            model = make_model()
            _compile(model, keras_parallel.DataParallel())
        kwargs = dict(batch_size=64, verbose=0, callbacks=callbacks)
        try:
            if kind == "fit":
                model.fit(x, y, epochs=1, **kwargs)
            elif kind == "evaluate":
                model.evaluate(x, y, **kwargs)
            else:
                model.predict(x, **kwargs)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
        for callback in callbacks:
            callback.close()  # Keras calls no callback after a failed run.
    x, y = make_data(256)
    model = make_model()
    _compile(model, keras_parallel.DataParallel())
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    return messages, history.history["loss"]


def tiny_batch():
    """batch_size 1 with 2 processes: a ValueError saying what to change."""
    import keras_parallel

    x, y = make_data(10)
    model = make_model()
    _compile(model, keras_parallel.DataParallel())
    model.fit(x, y, batch_size=1, epochs=1, verbose=0)


def echo(value, fail_rank=None):
    """Returns (rank, value); raises KeyError on `fail_rank`."""
    rank = int(os.environ["RANK"])
    if rank == fail_rank:
        raise KeyError(f"no such key on rank {rank}")
    return rank, value, os.environ["WORLD_SIZE"]


def sleep_forever():
    import time

    time.sleep(3600)


def chief_writes(directory, built=True):
    """Fits with progress, CSVLogger, ModelCheckpoint, then model.save.

    Returns what this rank printed, the files in `directory` after a
    barrier (so rank 1 sees rank 0's files), and what this rank found
    before it: the checkpoint right after `fit`, the weights `load_model`
    read right after `model.save`. Rank 0's writes land half a second late
    (`builders.slow_writes`). Each rank names its CSV log for itself
    (`log-<rank>.csv`): a rank that wrote would leave its own. With
    `built=False` the model is a Sequential without an input shape, built
    and planned inside its first `fit`, after Keras made the run's
    callbacks.
    """
    import contextlib
    import io

    keras = _keras()
    import torch.distributed as dist
    from builders import slow_writes

    import keras_parallel

    if os.environ["RANK"] == "0":
        slow_writes()
    found = {}

    x, y = make_data(256)
    if built:
        model = make_model()
    else:

        class Net(keras_parallel.DistributedModel, keras.Sequential):
            pass

        model = Net([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    _compile(model, keras_parallel.DataParallel())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.fit(
            x,
            y,
            batch_size=64,
            epochs=2,
            verbose=2,
            callbacks=[
                keras.callbacks.CSVLogger(
                    os.path.join(directory, f"log-{os.environ['RANK']}.csv")
                ),
                keras.callbacks.ModelCheckpoint(os.path.join(directory, "model.keras")),
            ],
        )
        found["checkpoint_after_fit"] = os.path.exists(
            os.path.join(directory, "model.keras")
        )
        model.save(os.path.join(directory, "model.keras"))
        # Uncompiled: the metric `RowCount` is a class of this function's.
        loaded = keras.saving.load_model(
            os.path.join(directory, "model.keras"), compile=False
        )
        found["loaded_as_saved"] = all(
            np.array_equal(a, b)
            for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True)
        )
        # Each rank's own paths: only rank 0's may appear.
        rank = os.environ["RANK"]
        model.save(os.path.join(directory, f"saved-{rank}.keras"))
        model.save_weights(os.path.join(directory, f"saved-{rank}.weights.h5"))
    dist.barrier()
    return printed.getvalue(), sorted(os.listdir(directory)), found


# ------------------------------------------- custom train_step (the guide)
def guide_model(variant, distributed=True):
    """A model whose `train_step` / `test_step` are the Keras guide's.

    "Customizing what happens in fit() with PyTorch" (keras.io, Keras 3),
    with a `split_probe.probe()` after the Input:

    - `"metrics"`: updates `self.metrics` (the loss tracker and the compiled
      metrics) and returns `{m.name: m.result() for m in self.metrics}`, so
      `compile_metrics` is a key of the logs (compiled with `loss="mse"`,
      `metrics=["mae"]`);
    - `"own_metrics"`: its own `loss_tracker` and `mae_metric` (Mean
      metrics, listed by its `metrics` property) and `loss_fn`;
    - `"tensors"`: returns the step's own tensors, `{"loss": loss, "mae":
      mean |y - y_pred|}`, not metric results.

    Args:
        variant: one of the above.
        distributed: False makes a plain Keras model.

    Returns:
        The uncompiled model (`compile_guide_model` compiles it).
    """
    keras = _keras()
    import torch

    import keras_parallel

    base = keras.Model
    if distributed:

        class Base(keras_parallel.DistributedModel, keras.Model):
            pass

        base = Base

    def apply_gradients(model, loss):
        loss.backward()
        trainable_weights = [v for v in model.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            model.optimizer.apply(gradients, trainable_weights)

    class GuideMetrics(base):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            apply_gradients(self, loss)
            return self._update(loss, y, y_pred)

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            return self._update(loss, y, y_pred)

        def _update(self, loss, y, y_pred):
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    class GuideOwnMetrics(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
            apply_gradients(self, loss)
            return self._update(loss, y, y_pred)

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            return self._update(self.loss_fn(y, y_pred), y, y_pred)

        def _update(self, loss, y, y_pred):
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    class GuideTensors(base):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            apply_gradients(self, loss)
            return {"loss": loss, "mae": keras.ops.mean(keras.ops.abs(y - y_pred))}

    model_class = {
        "metrics": GuideMetrics,
        "own_metrics": GuideOwnMetrics,
        "tensors": GuideTensors,
    }[variant]
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    x = split_probe.probe()(inputs)
    x = keras.layers.Dense(16, activation="tanh")(x)
    outputs = keras.layers.Dense(1)(x)
    return model_class(inputs, outputs)


def guide_train(
    variant="metrics",
    n=512,
    epochs=2,
    record_step_logs=False,
    nested=None,
    distributed=True,
):
    """Fits a `guide_model`; returns its History, step logs, evaluation.

    Args:
        variant: `guide_model`'s variant.
        n: samples, at batch 64 (512: 32 rows per rank in every step of 2;
            1003: a last batch of 43, 22 and 21 rows).
        epochs: epochs, with the first 128 samples as validation data.
        record_step_logs: a callback reads every train step's logs (they
            are then made global after every step).
        nested: `"plain_on_rank_0"`: a callback evaluates a plain model on
            rank 0 alone at the start of train step 2; `"distributed"`: it
            evaluates another distributed model (on every rank) there.
        distributed: False fits the same model in plain Keras.

    Returns:
        `{"weights", "history", "step_logs", "evaluation", "predictions",
        "split"}`.
    """
    keras = _keras()
    import keras_parallel

    rank = int(os.environ.get("RANK", "0"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, :1] * 0.5 + rng.normal(size=(n, 1)) * 0.1).astype("float32")
    model = guide_model(variant, distributed)
    kwargs = {}
    if distributed:
        kwargs["distribution"] = keras_parallel.DataParallel()
    if variant == "own_metrics":
        model.compile(optimizer=keras.optimizers.SGD(0.1), **kwargs)
    else:
        metrics = ["mae"] if variant == "metrics" else None
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=metrics, **kwargs
        )
    step_logs = []
    callbacks = []
    if record_step_logs:

        class StepLogs(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                step_logs.append({k: float(v) for k, v in logs.items()})

        callbacks.append(StepLogs())
    if nested is not None:
        # No probe in it: the rows recorded are the outer model's.
        inner_distributed = distributed and nested == "distributed"
        other_class = keras.Model
        if inner_distributed:

            class Other(keras_parallel.DistributedModel, keras.Model):
                pass

            other_class = Other
        other_inputs = keras.Input((6,))
        other = other_class(other_inputs, keras.layers.Dense(3)(other_inputs))
        _compile(other, keras_parallel.DataParallel() if inner_distributed else None)
        data_x, data_y = make_data(256)

        class EvaluateAnother(keras.callbacks.Callback):
            # `on_train_batch_begin`: no step-log reader, so the outer fit
            # keeps its own choice (per epoch without `record_step_logs`).
            def on_train_batch_begin(self, batch, logs=None):
                if batch != 2 or (nested == "plain_on_rank_0" and rank != 0):
                    return
                other.evaluate(data_x, data_y, batch_size=64, verbose=0)

        callbacks.append(EvaluateAnother())
    split_probe.clear()
    history = model.fit(
        x,
        y,
        batch_size=64,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        validation_data=(x[:128], y[:128]),
        callbacks=callbacks,
    )
    split = split_probe.records()
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    return {
        "weights": weights_of(model),
        "history": {k: list(map(float, v)) for k, v in history.history.items()},
        "step_logs": step_logs,
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "predictions": np.asarray(model.predict(x[:203], batch_size=64, verbose=0)),
        "split": split,
    }


def guide_scenarios(cases):
    """Runs `guide_train(**case)` for each case in one process."""
    return [guide_train(**case) for case in cases]
