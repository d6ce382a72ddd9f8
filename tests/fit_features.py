"""The everyday `fit` surface, as one table of cases, run on every backend.

Each `Case` is one feature a Keras user reaches for (mixed precision,
gradient accumulation, a custom `train_step`, dict inputs, a `PyDataset`,
...): a model builder, the `compile` arguments, how it is trained, and the
columns (backend x distribution) it does not apply to, with the reason.
`run()` trains a case once, on one device (`column=None`: plain Keras, the
reference) or distributed through one door, and returns plain values: the
weights, every History, evaluate's logs, the predictions, what the case's
own training returned (`extra`), and the rows the `BatchProbe` saw.

`tests/test_fit_features.py` runs every case on the suite's backend and
compares with one device; the torch ranks run `torch_run` (this module is
imported by name in every spawned process). `docs/features.md` holds the
table `features_table()` writes; a test keeps the two equal. Regenerate
the table with `python tests/fit_features.py`.

Every model puts a probe first (no variables: the weights are those of the
model without it) and names its hidden layer `d1` and its output `head`,
so that one `LayoutMap` (`layout_map`) splits every model on a
`ModelParallel` mesh.
"""

import contextlib
import dataclasses
import functools
import os
import traceback

import numpy as np
import split_probe

#: `(column id, backend, distribution kind, docs heading)`.
COLUMNS = (
    ("jax-data", "jax", "data", "JAX DataParallel"),
    ("jax-model", "jax", "model", "JAX ModelParallel"),
    ("torch-data", "torch", "data", "torch DataParallel"),
    ("torch-model", "torch", "model", "torch ModelParallel"),
    ("tensorflow-data", "tensorflow", "data", "TensorFlow DataParallel"),
)
COLUMN_IDS = tuple(column[0] for column in COLUMNS)
DOORS = ("mixin", "callback")

#: Processes of the torch launches: DataParallel over 2 ranks, and a
#: `(2, 2)` ModelParallel mesh over 4.
TORCH_PROCESSES = {"torch-data": 2, "torch-model": 4}
#: Logical TensorFlow devices a DataParallel spans, of the 4 that
#: tests/conftest.py makes: two trace in half the time of four, and still
#: split the last batch unevenly.
TENSORFLOW_DEVICES = 2
TENSORFLOW_LOGICAL_DEVICES = 4

FEATURES = 16
OUTPUTS = 8
#: 203 rows at batch 32: 6 batches and a last one of 11, which none of the
#: device counts here divides (8: 2 rows each, the last padded; 4: 3,3,3,2;
#: 2: 6 and 5). Every case trains on that uneven batch too.
ROWS = 203
BATCH = 32
SEED = 7


# ---------------------------------------------------------------- limits
@dataclasses.dataclass(frozen=True)
class Limit:
    """Why a case does not run in a column.

    Attributes:
        reason: one sentence, shown by the skip and in docs/features.md.
        keras: Keras itself refuses it on one device of that backend (the
            test checks that it still does); else a keras_parallel limit.
        match: what Keras's error says (a regex), where `keras`.
        before_keras: `(major, minor)`: the limit holds for older Keras only.
    """

    reason: str
    keras: bool = False
    match: str = ""
    before_keras: tuple = ()

    def holds(self):
        """Whether the limit holds with the Keras installed."""
        if not self.before_keras:
            return True
        import keras

        installed = tuple(int(p) for p in keras.version().split(".")[:2])
        return installed < self.before_keras


TORCH_STEPS_PER_EXECUTION = Limit(
    "Keras's torch trainer refuses `steps_per_execution > 1`, on one device "
    "too (before Keras 3.16, which runs it)",
    keras=True,
    match="steps_per_execution. must be 1",
    before_keras=(3, 16),
)
TORCH_LOCAL_BATCHNORM = Limit(
    "By default each rank normalises its own rows, as DDP does; "
    "`keras_parallel.DataParallel(sync_batchnorm=True)` uses the global "
    "batch's statistics, as one device does (tests/test_torch_executor.py)"
)
JAX_EAGER_UNEVEN = (
    "Uncompiled, JAX computes a batch the devices do not divide (the "
    "epoch's last) whole on every device, exactly; every other batch is "
    "split (only a compiled step can pad the last device's share)"
)
TORCH_MESH_UNCOMPILED = Limit(
    "Under a torch ModelParallel, keras_parallel runs the steps uncompiled "
    "and warns: `torch.compile` of a forward pass over DTensor variables "
    "fails in AOTAutograd (tests/test_torch_model_parallel.py checks the "
    "warning)"
)
TENSORFLOW_XLA_PROBE = Limit(
    "Not tested here: the probe that proves the split records through "
    "`tf.numpy_function`, which XLA cannot compile (the step is Keras's own "
    "`tf.distribute` step either way)"
)
ON_BATCH_NO_CALLBACKS = (
    "`*_on_batch` calls no callback, so only the `compile(distribution=...)` "
    "door can distribute it"
)
#: Why a case that tests a step runs through the compile door alone: the
#: `ShardingCallback` door differs only in how a run starts and ends
#: (tested through both doors by every other row), and runs the same steps.
STEP_ONLY = (
    "tested through the compile door; through `ShardingCallback` the same "
    "steps run, and how a run starts and ends is tested by the rows without "
    "this note"
)
#: Why a ModelParallel column runs every case through the compile door
#: alone: a door is how a run starts and ends, the column how variables and
#: batches are laid out; the two do not meet inside a step. The
#: `ShardingCallback` door runs every case in each backend's DataParallel
#: column, and with a `ModelParallel` in tests/test_callback.py.
MODEL_COLUMN_DOOR = (
    "a ModelParallel column runs through the compile door; "
    "`ShardingCallback` with `ModelParallel` is tested in tests/test_callback.py"
)


# ---------------------------------------------------------------- models
def _keras():
    import keras

    return keras


def probe():
    """A `split_probe` BatchProbe that also sees JAX's eager steps.

    `split_probe` records a JAX batch's sharding inside a compiled step (a
    tracer); with `run_eagerly=True` (or `jit_compile=False`) Keras runs
    JAX's step uncompiled, and the batch arrives as a concrete array whose
    sharding is recorded here the same way: global rows, rows of one shard.
    """
    base = type(split_probe.probe())
    keras = _keras()
    if keras.backend.backend() != "jax":
        return base(name="batch_probe")
    return _jax_eager_probe_class(base)(name="batch_probe")


_EAGER_CLASSES = {}


def _jax_eager_probe_class(base):
    if base not in _EAGER_CLASSES:

        class EagerAwareProbe(base):
            def call(self, x):
                import jax

                if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
                    shard = x.addressable_shards[0].data
                    EAGER_RECORDS.append((int(x.shape[0]), int(shard.shape[0])))
                return super().call(x)

        _EAGER_CLASSES[base] = EagerAwareProbe
    return _EAGER_CLASSES[base]


#: JAX eager steps' `(global_rows, device_rows)`, beside `split_probe`'s.
EAGER_RECORDS = []


def mlp(model_class, outputs=OUTPUTS, activation=None):
    """Input(16) -> probe -> d1 (32, relu) -> head (`outputs`)."""
    keras = _keras()
    inputs = keras.Input((FEATURES,))
    x = probe()(inputs)
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    y = keras.layers.Dense(outputs, activation=activation, name="head")(x)
    return model_class(keras.Model)(inputs=inputs, outputs=y)


def classifier(model_class):
    """Four classes, softmax."""
    return mlp(model_class, outputs=4, activation="softmax")


def binary(model_class):
    """One sigmoid output."""
    return mlp(model_class, outputs=1, activation="sigmoid")


def batchnorm(model_class):
    """The mlp with a BatchNormalization after d1 (which has no bias)."""
    keras = _keras()
    inputs = keras.Input((FEATURES,))
    x = probe()(inputs)
    # No bias: before a BatchNormalization its gradient is 0, and its value
    # float noise that no relative comparison can hold.
    x = keras.layers.Dense(32, use_bias=False, name="d1")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Activation("relu")(x)
    y = keras.layers.Dense(OUTPUTS, name="head")(x)
    return model_class(keras.Model)(inputs=inputs, outputs=y)


def regularized(model_class):
    """Kernel and bias regularizers on d1, an L2 kernel regularizer on head."""
    keras = _keras()
    inputs = keras.Input((FEATURES,))
    x = probe()(inputs)
    x = keras.layers.Dense(
        32,
        activation="relu",
        name="d1",
        kernel_regularizer=keras.regularizers.L2(1e-2),
        bias_regularizer=keras.regularizers.L1(1e-2),
    )(x)
    y = keras.layers.Dense(
        OUTPUTS, name="head", kernel_regularizer=keras.regularizers.L1L2(1e-3, 1e-3)
    )(x)
    return model_class(keras.Model)(inputs=inputs, outputs=y)


def _penalty_layer():
    keras = _keras()

    class MeanSquarePenalty(keras.layers.Layer):
        """`add_loss` of 0.1 * the mean square activation: a batch mean."""

        def call(self, x):
            self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
            return x

    return MeanSquarePenalty(name="penalty")


def added_losses(model_class):
    """A layer's `add_loss` (a batch mean) and an activity regularizer (a
    sum over the batch's rows, as Keras's regularizers compute it)."""
    keras = _keras()
    inputs = keras.Input((FEATURES,))
    x = probe()(inputs)
    x = keras.layers.Dense(
        32,
        activation="relu",
        name="d1",
        activity_regularizer=keras.regularizers.L2(1e-3),
    )(x)
    x = _penalty_layer()(x)
    y = keras.layers.Dense(OUTPUTS, name="head")(x)
    return model_class(keras.Model)(inputs=inputs, outputs=y)


def dict_model(model_class):
    """Inputs `{"a", "b"}`, outputs `{"main", "aux"}` (layers head and aux)."""
    keras = _keras()
    a = keras.Input((FEATURES,), name="a")
    b = keras.Input((4,), name="b")
    x = keras.layers.Concatenate()([probe()(a), b])
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    main = keras.layers.Dense(OUTPUTS, name="head")(x)
    aux = keras.layers.Dense(2, name="aux")(x)
    return model_class(keras.Model)(
        inputs={"a": a, "b": b}, outputs={"main": main, "aux": aux}
    )


def sequential(model_class):
    keras = _keras()
    return model_class(keras.Sequential)(
        [
            keras.Input((FEATURES,)),
            probe(),
            keras.layers.Dense(32, activation="relu", name="d1"),
            keras.layers.Dense(OUTPUTS, name="head"),
        ]
    )


def subclassed(model_class):
    """A subclassed model, unbuilt until its first `fit`."""
    keras = _keras()

    class Mlp(model_class(keras.Model)):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.probe = probe()
            self.d1 = keras.layers.Dense(32, activation="relu", name="d1")
            self.head = keras.layers.Dense(OUTPUTS, name="head")

        def call(self, x):
            return self.head(self.d1(self.probe(x)))

    return Mlp()


VOCABULARY = 40
SEQUENCE = 4


def lstm_embedding(model_class):
    """Tokens -> Embedding -> LSTM -> d1 -> head (4 classes)."""
    keras = _keras()
    inputs = keras.Input((SEQUENCE,), dtype="int32")
    x = probe()(inputs)
    x = keras.layers.Embedding(VOCABULARY, 8, name="embed")(x)
    x = keras.layers.LSTM(8, name="lstm")(x)
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    y = keras.layers.Dense(4, name="head")(x)
    return model_class(keras.Model)(inputs=inputs, outputs=y)


def custom_train_step(model_class):
    """The mlp as the Keras guide "Customizing what happens in fit()" writes
    its `CustomModel` for this backend: its own gradient step, the loss from
    `compile`, the metrics updated by hand."""
    keras = _keras()
    base = guide_custom_model()
    inputs = keras.Input((FEATURES,))
    x = probe()(inputs)
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    y = keras.layers.Dense(OUTPUTS, name="head")(x)
    return model_class(base)(inputs=inputs, outputs=y)


def guide_custom_model():
    """The `CustomModel` class of the Keras guide "Customizing what happens
    in fit()" for the backend Keras runs on, as the guide writes it."""
    return {
        "jax": _jax_custom_model,
        "torch": _torch_custom_model,
        "tensorflow": _tensorflow_custom_model,
    }[_keras().backend.backend()]()


def _jax_custom_model():
    """custom_train_step_in_jax.py, "A first simple example"."""
    import jax

    keras = _keras()

    class CustomModel(keras.Model):
        def guide_loss_and_updates(
            self,
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
            x,
            y,
            sample_weight,
            training=False,
        ):
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=training
            )
            (
                loss,
                (
                    trainable_variables,
                    non_trainable_variables,
                    metrics_variables,
                ),
            ) = self.stateless_compute_loss(
                trainable_variables,
                non_trainable_variables,
                metrics_variables,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=training,
            )
            return loss, (y_pred, non_trainable_variables, metrics_variables)

        def train_step(self, state, data):
            (
                trainable_variables,
                non_trainable_variables,
                optimizer_variables,
                metrics_variables,
            ) = state
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            grad_fn = jax.value_and_grad(self.guide_loss_and_updates, has_aux=True)
            (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = (
                grad_fn(
                    trainable_variables,
                    non_trainable_variables,
                    metrics_variables,
                    x,
                    y,
                    sample_weight,
                    training=True,
                )
            )
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
            new_metrics_vars = []
            logs = {}
            for metric in self.metrics:
                this_metric_vars = metrics_variables[
                    len(new_metrics_vars) : len(new_metrics_vars)
                    + len(metric.variables)
                ]
                if metric.name == "loss":
                    this_metric_vars = metric.stateless_update_state(
                        this_metric_vars, loss, sample_weight=sample_weight
                    )
                else:
                    this_metric_vars = metric.stateless_update_state(
                        this_metric_vars, y, y_pred, sample_weight=sample_weight
                    )
                logs[metric.name] = metric.stateless_result(this_metric_vars)
                new_metrics_vars += this_metric_vars
            state = (
                trainable_variables,
                non_trainable_variables,
                optimizer_variables,
                new_metrics_vars,
            )
            return logs, state

    return CustomModel


def _torch_custom_model():
    """custom_train_step_in_torch.py, "A first simple example"."""
    import torch

    keras = _keras()

    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            loss.backward()
            trainable_weights = [v for v in self.trainable_weights]
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return CustomModel


def _tensorflow_custom_model():
    """custom_train_step_in_tensorflow.py, "A first simple example"."""
    import tensorflow as tf

    keras = _keras()

    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return CustomModel


def layout_map(mesh):
    """Megatron's split of every case's model: d1's kernel by columns, head's
    by rows (a key that matches nothing warns, an error in this suite: every
    model has both kernels)."""
    keras = _keras()
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*d1/kernel"] = (None, "model")
    layouts[".*head/kernel"] = ("model", None)
    return layouts


# ------------------------------------------------------------------ data
@dataclasses.dataclass
class Data:
    """What a case trains on; `x`, `y` are also what evaluate and predict get."""

    x: object
    y: object
    fit: dict = dataclasses.field(default_factory=dict)


def _features(rows=ROWS, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, FEATURES)).astype("float32")


def regression():
    rng = np.random.default_rng(1)
    # Targets of scale 3: gradients large enough that clipping at 0.1 clips.
    return Data(_features(), (3 * rng.normal(size=(ROWS, OUTPUTS))).astype("float32"))


def labels():
    x = _features()
    # Learnable and uneven: class 0 is the most frequent.
    y = np.clip(np.floor(x[:, 0] + 1.5), 0, 3).astype("int32")
    return Data(x, y)


def binary_labels():
    x = _features()
    return Data(x, (x[:, 0] + 0.5 * x[:, 1] > 0.2).astype("float32")[:, None])


def dict_data():
    x = _features()
    rng = np.random.default_rng(2)
    inputs = {"a": x, "b": rng.normal(size=(ROWS, 4)).astype("float32")}
    targets = {
        "main": rng.normal(size=(ROWS, OUTPUTS)).astype("float32"),
        "aux": rng.normal(size=(ROWS, 2)).astype("float32"),
    }
    return Data(inputs, targets)


def sequences():
    rng = np.random.default_rng(3)
    x = rng.integers(0, VOCABULARY, size=(ROWS, SEQUENCE)).astype("int32")
    return Data(x, (x[:, 0] % 4).astype("int32"))


def with_sample_weight():
    data = regression()
    weights = np.random.default_rng(4).uniform(0.0, 2.0, size=(ROWS,))
    data.fit = {"sample_weight": weights.astype("float32")}
    return data


def with_class_weight():
    data = labels()
    data.fit = {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5, 3: 3.0}}
    return data


def with_validation_data():
    data = regression()
    rng = np.random.default_rng(5)
    x_val = rng.normal(size=(45, FEATURES)).astype("float32")
    y_val = (3 * rng.normal(size=(45, OUTPUTS))).astype("float32")
    data.fit = {"validation_data": (x_val, y_val), "epochs": 2}
    return data


def with_validation_split():
    data = regression()
    data.fit = {"validation_split": 0.2, "epochs": 2}
    return data


def shuffled_epochs():
    data = regression()
    data.fit = {"shuffle": True, "epochs": 2}
    return data


def _batches(x, y):
    """The global batches of `BATCH` rows, the last one short."""
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def as_pydataset():
    keras = _keras()
    data = regression()

    class Batches(keras.utils.PyDataset):
        def __init__(self, batches):
            super().__init__()
            self.batches = batches

        def __len__(self):
            return len(self.batches)

        def __getitem__(self, index):
            return self.batches[index]

    data.fit = {"x": Batches(_batches(data.x, data.y)), "y": None, "batch_size": None}
    return data


def as_generator():
    data = regression()

    def batches(pairs):
        yield from pairs

    # A generator is consumed once: one epoch, its length unknown to Keras.
    data.fit = {"x": batches(_batches(data.x, data.y)), "y": None, "batch_size": None}
    return data


def as_tf_data():
    import tensorflow as tf

    data = regression()
    dataset = tf.data.Dataset.from_tensor_slices((data.x, data.y)).batch(BATCH)
    data.fit = {"x": dataset, "y": None, "batch_size": None}
    return data


def plateau_data():
    data = with_validation_data()
    data.fit["epochs"] = 8
    return data


# --------------------------------------------------------------- compile
def _sgd(**kwargs):
    keras = _keras()
    return keras.optimizers.SGD(kwargs.pop("learning_rate", 0.05), **kwargs)


def mse(**optimizer):
    """`compile` arguments: SGD (with `optimizer`'s arguments), mse, mae."""

    def arguments():
        return {"optimizer": _sgd(**optimizer), "loss": "mse", "metrics": ["mae"]}

    return arguments


def mse_with(**compile_kwargs):
    """SGD, mse, mae and further `compile` arguments."""

    def arguments():
        return dict(mse()(), **compile_kwargs)

    return arguments


def adam():
    keras = _keras()
    return {
        "optimizer": keras.optimizers.Adam(1e-2),
        "loss": "mse",
        "metrics": ["mae"],
    }


def lr_schedule():
    keras = _keras()
    schedule = keras.optimizers.schedules.ExponentialDecay(
        0.1, decay_steps=2, decay_rate=0.5
    )
    return {
        "optimizer": keras.optimizers.SGD(schedule),
        "loss": "mse",
        "metrics": ["mae"],
    }


def sparse_categorical():
    return {
        "optimizer": _sgd(learning_rate=0.2),
        "loss": "sparse_categorical_crossentropy",
        "metrics": ["accuracy"],
        "weighted_metrics": ["accuracy"],
    }


def logits_categorical():
    keras = _keras()
    return {
        "optimizer": _sgd(learning_rate=0.2),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": ["accuracy"],
    }


def auc_precision():
    keras = _keras()
    return {
        "optimizer": _sgd(learning_rate=0.2),
        "loss": "binary_crossentropy",
        "metrics": [
            # Fewer thresholds than the default 200: the same histogram of
            # predictions (a scatter-add), compiled faster.
            keras.metrics.AUC(num_thresholds=50, name="auc"),
            keras.metrics.Precision(name="precision"),
            keras.metrics.Recall(name="recall"),
            "accuracy",
        ],
    }


def dict_losses():
    return {
        "optimizer": _sgd(),
        "loss": {"main": "mse", "aux": "mae"},
        "loss_weights": {"main": 1.0, "aux": 0.5},
        "metrics": {"main": ["mae"], "aux": ["mse"]},
    }


def weighted_mse():
    return dict(mse()(), weighted_metrics=["mae"])


# ----------------------------------------------------------------- train
def fit_once(model, data, callbacks):
    """One `fit`; returns `(histories, extra)`."""
    kwargs = {"x": data.x, "y": data.y, "batch_size": BATCH, "shuffle": False}
    kwargs.update(data.fit)
    history = model.fit(verbose=0, callbacks=callbacks, **kwargs)
    return [history.history], {}


def fit_twice(model, data, callbacks):
    """Two `fit` calls in a row: the second continues the first."""
    first, _ = fit_once(model, data, callbacks)
    second, _ = fit_once(model, data, callbacks)
    return first + second, {}


def with_step_logs(model, data, callbacks):
    """`fit` with a callback that reads every step's logs."""
    keras = _keras()
    step_logs = []

    class StepLogs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step_logs.append({k: float(v) for k, v in logs.items()})

    histories, _ = fit_once(model, data, [*callbacks, StepLogs()])
    return histories, {"step_logs": step_logs}


def with_plateau_callbacks(model, data, callbacks):
    """`ReduceLROnPlateau` and `EarlyStopping` on `val_loss`: their decisions
    (the learning rates in the History, the epoch it stops at) equal one
    device's only if the logs they read are."""
    keras = _keras()
    deciders = [
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss", factor=0.5, patience=0, min_delta=0.02
        ),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.02),
    ]
    histories, _ = fit_once(model, data, [*callbacks, *deciders])
    return histories, {"epochs": len(histories[0]["loss"])}


def on_batch(model, data, callbacks):
    """`train_on_batch` on three batches (the last one of 11 rows), then
    `test_on_batch` and `predict_on_batch`."""
    del callbacks  # `*_on_batch` takes none.
    logs = []
    for start, stop in ((0, BATCH), (BATCH, 2 * BATCH), (ROWS - 11, ROWS)):
        logs.append(
            model.train_on_batch(
                data.x[start:stop], data.y[start:stop], return_dict=True
            )
        )
    tested = model.test_on_batch(data.x[:BATCH], data.y[:BATCH], return_dict=True)
    predicted = model.predict_on_batch(data.x[:BATCH])
    return [], {
        "train_on_batch": [{k: float(v) for k, v in x.items()} for x in logs],
        "test_on_batch": {k: float(v) for k, v in tested.items()},
        "predict_on_batch": np.asarray(predicted),
    }


@contextlib.contextmanager
def torch_compile_without_codegen():
    """`torch.compile` through TorchDynamo and AOTAutograd, without Inductor.

    What keras_parallel's steps meet under `jit_compile=True` is Dynamo's
    tracing and AOTAutograd's backward; Inductor's code generation then
    compiles C++ for each shape (measured: 127 s for this MLP's one-device
    `fit`, `evaluate` and `predict`, against 2 s with `"aot_eager"`).
    """
    if _keras().backend.backend() != "torch":
        yield
        return
    import torch

    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")
    try:
        yield
    finally:
        torch.compile = compile_


# ----------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    """One feature of `fit`, and where it runs.

    Attributes:
        name: the test id.
        feature: its row in docs/features.md.
        build: `build(model_class)`: a model, its classes made by
            `model_class(keras_class)` (the `DistributedModel` subclass on
            the compile door, the class itself elsewhere).
        compile: `compile()`: fresh `compile` arguments.
        data: `data()`: a `Data`.
        train: `train(model, data, callbacks)`: `(histories, extra)`.
        dtype_policy: the global dtype policy while the model is built and
            trained (mixed precision), restored after.
        keras_defaults: the distribution is Keras's own class over Keras's
            default devices (`keras.distribution.list_devices()`), not
            `keras_parallel.DataParallel()` or a mesh given its devices.
        doors: the doors it runs through.
        door_note: why a door is left out.
        step_only: the case tests what a step computes, which both doors
            share: it runs through the compile door alone (`STEP_ONLY`).
        limits: `{column id: Limit}` where it does not run.
        uneven_whole: `{column id: reason}` where a batch the devices do
            not divide (the epoch's last) is computed whole on every device
            (exact, but not split), and why.
        rtol: the largest relative difference of any weight, log or
            prediction from one device's.
        why_rtol: why `rtol` is not the default.
        needs: a module the case needs that a backend's environment may
            lack (the tox jax env has no TensorFlow): skipped without it.
        within: `within()`: a context manager in force while the case runs
            (on one device too), or None.
        reference: the case whose one-device run the columns are compared
            with, where it computes the same numbers at a fraction of the
            cost (None: this case's own).
    """

    name: str
    feature: str
    build: object = mlp
    compile: object = mse()
    data: object = regression
    train: object = fit_once
    dtype_policy: str = None
    keras_defaults: bool = False
    doors: tuple = DOORS
    door_note: str = ""
    step_only: bool = False
    limits: dict = dataclasses.field(default_factory=dict)
    uneven_whole: dict = dataclasses.field(default_factory=dict)
    rtol: float = 1e-5
    why_rtol: str = ""
    needs: str = None
    within: object = None
    reference: str = None

    def limit(self, column):
        limit = self.limits.get(column)
        return limit if limit is not None and limit.holds() else None


# Measured here, the largest relative difference of any weight from one
# device's, over every column: float16 8.4e-4 (JAX), bfloat16 2.7e-2
# (torch); one device's own bfloat16 run is 2.7e-2 from its float32 run.
LOW_PRECISION = (
    "the forward and backward passes round to 11 (float16) or 8 (bfloat16) "
    "bits: a batch's gradient summed per device, then across devices, "
    "rounds differently from one device's sum (measured: up to 8.4e-4 in "
    "float16, 2.7e-2 in bfloat16, as far as one device's bfloat16 run is "
    "from its float32 run)"
)

CASES = {
    case.name: case
    for case in (
        Case("baseline", "plain `fit`: SGD, mse, an uneven last batch"),
        Case(
            "adam_shuffled",
            "Adam, 2 epochs, `shuffle=True`",
            compile=adam,
            data=shuffled_epochs,
        ),
        Case(
            "mixed_float16",
            'mixed precision `"mixed_float16"` (loss scaling)',
            dtype_policy="mixed_float16",
            rtol=5e-3,
            why_rtol=LOW_PRECISION,
            step_only=True,
        ),
        Case(
            "mixed_bfloat16",
            'mixed precision `"mixed_bfloat16"`',
            dtype_policy="mixed_bfloat16",
            rtol=5e-2,
            why_rtol=LOW_PRECISION,
            step_only=True,
        ),
        Case(
            "gradient_accumulation",
            "`gradient_accumulation_steps=2`",
            compile=mse(gradient_accumulation_steps=2),
            step_only=True,
        ),
        Case(
            "ema",
            "`use_ema=True`",
            compile=mse(use_ema=True, ema_momentum=0.5),
            step_only=True,
        ),
        Case("clipnorm", "`clipnorm`", compile=mse(clipnorm=0.1), step_only=True),
        Case(
            "global_clipnorm",
            "`global_clipnorm`",
            compile=mse(global_clipnorm=0.1),
            step_only=True,
        ),
        Case(
            "custom_train_step",
            'a custom `train_step` (the Keras guide "Customizing what happens '
            'in fit()" for the backend)',
            build=custom_train_step,
            step_only=True,
        ),
        Case(
            "dict_io_loss_weights",
            "dict inputs and outputs, a loss and metrics per output, `loss_weights`",
            build=dict_model,
            compile=dict_losses,
            data=dict_data,
            step_only=True,
        ),
        Case(
            "sample_weight",
            "`sample_weight`, `weighted_metrics`",
            compile=weighted_mse,
            data=with_sample_weight,
            step_only=True,
        ),
        Case(
            "class_weight",
            "`class_weight`, sparse categorical cross-entropy, accuracy",
            build=classifier,
            compile=sparse_categorical,
            data=with_class_weight,
            step_only=True,
        ),
        Case(
            "validation_data",
            "`validation_data`",
            data=with_validation_data,
        ),
        Case(
            "validation_split",
            "`validation_split`",
            data=with_validation_split,
        ),
        Case(
            "steps_per_execution",
            "`steps_per_execution=3`",
            compile=mse_with(steps_per_execution=3),
            limits={
                "torch-data": TORCH_STEPS_PER_EXECUTION,
                "torch-model": TORCH_STEPS_PER_EXECUTION,
            },
        ),
        # `jit_compile=False` is the default of TensorFlow on a CPU and of
        # torch; on JAX it runs the step uncompiled, as `run_eagerly` does.
        Case(
            "run_eagerly",
            "`run_eagerly=True`, `jit_compile=False`",
            compile=mse_with(run_eagerly=True, jit_compile=False),
            uneven_whole={
                "jax-data": JAX_EAGER_UNEVEN,
                "jax-model": JAX_EAGER_UNEVEN,
            },
        ),
        # Keras compiles its steps when asked: with `torch.compile` on torch
        # (the steps keras_parallel wraps are traced too), with XLA on
        # TensorFlow; on JAX it is the default every other row runs.
        Case(
            "jit_compile",
            "`jit_compile=True` (`torch.compile` on torch, XLA on TensorFlow)",
            compile=mse_with(jit_compile=True),
            within=torch_compile_without_codegen,
            # Keras's torch step compiled whole on one device: 111 frames
            # traced, 129 s here; the same numbers as the uncompiled step
            # (measured: 8.4e-8 apart).
            reference="baseline",
            limits={
                "torch-model": TORCH_MESH_UNCOMPILED,
                "tensorflow-data": TENSORFLOW_XLA_PROBE,
            },
        ),
        Case(
            "auc_precision",
            "AUC, Precision, Recall, binary cross-entropy",
            build=binary,
            compile=auc_precision,
            data=binary_labels,
            step_only=True,
        ),
        Case("pydataset", "a `keras.utils.PyDataset`", data=as_pydataset),
        Case("generator", "a Python generator", data=as_generator),
        Case("tf_data", "a `tf.data.Dataset`", data=as_tf_data, needs="tensorflow"),
        Case(
            "batchnorm",
            "BatchNormalization (the global batch's statistics)",
            build=batchnorm,
            limits={"torch-data": TORCH_LOCAL_BATCHNORM},
            step_only=True,
        ),
        Case(
            "regularizers",
            "kernel and bias regularizers",
            build=regularized,
            step_only=True,
        ),
        Case(
            "add_loss",
            "`add_loss` in a layer, an activity regularizer",
            build=added_losses,
            step_only=True,
        ),
        Case(
            "lr_schedule",
            "a learning-rate schedule",
            compile=lr_schedule,
            step_only=True,
        ),
        Case(
            "plateau_early_stopping",
            "`ReduceLROnPlateau`, `EarlyStopping`",
            data=plateau_data,
            train=with_plateau_callbacks,
        ),
        Case(
            "step_logs",
            "a callback reading every step's logs",
            train=with_step_logs,
        ),
        Case(
            "on_batch",
            "`train_on_batch`, `test_on_batch`, `predict_on_batch`",
            train=on_batch,
            doors=("mixin",),
            door_note=ON_BATCH_NO_CALLBACKS,
        ),
        Case("repeated_fit", "`fit` twice in a row", train=fit_twice),
        Case(
            "lstm_embedding",
            "Embedding + LSTM",
            build=lstm_embedding,
            compile=logits_categorical,
            data=sequences,
            step_only=True,
        ),
        Case("sequential", "a `keras.Sequential`", build=sequential),
        Case("subclassed", "a subclassed model, unbuilt until `fit`", build=subclassed),
        Case(
            "keras_default_devices",
            "Keras's own `DataParallel()` / `DeviceMesh(shape, axes)` over "
            "`keras.distribution.list_devices()`",
            keras_defaults=True,
        ),
    )
}


# ---------------------------------------------------------- distributions
def ways(column, keras_defaults=False):
    """How many ways a column splits each global batch.

    With `keras_defaults`, TensorFlow's DataParallel spans every logical
    device Keras lists: the 4 of tests/conftest.py.
    """
    if keras_defaults and column == "tensorflow-data":
        return TENSORFLOW_LOGICAL_DEVICES
    return {
        "jax-data": 8,
        "jax-model": 4,
        "torch-data": TORCH_PROCESSES["torch-data"],
        "torch-model": TORCH_PROCESSES["torch-model"] // 2,
        "tensorflow-data": TENSORFLOW_DEVICES,
    }[column]


def distribution(column, keras_defaults=False):
    """The distribution of `column`, in this process.

    JAX: DataParallel over the 8 simulated devices, ModelParallel over a
    `(4, 2)` mesh. torch: DataParallel over the ranks, ModelParallel over a
    `(ranks / 2, 2)` mesh. TensorFlow: DataParallel over
    `TENSORFLOW_DEVICES` logical CPU devices.
    """
    keras = _keras()
    import keras_parallel

    kind = column.split("-")[1]
    if keras_defaults:
        # Keras's classes, finding the devices themselves.
        if kind == "data":
            return keras.distribution.DataParallel()
        mesh = keras.distribution.DeviceMesh(_mesh_shape(column), ["data", "model"])
    else:
        if column == "tensorflow-data":
            devices = [f"cpu:{i}" for i in range(TENSORFLOW_DEVICES)]
            return keras_parallel.DataParallel(devices=devices)
        if kind == "data":
            return keras_parallel.DataParallel()
        # Keras 3.15 cannot list torch devices: the mesh is given them.
        devices = keras_parallel.DataParallel().device_mesh.devices.ravel().tolist()
        mesh = keras.distribution.DeviceMesh(
            _mesh_shape(column), ["data", "model"], devices
        )
    return keras.distribution.ModelParallel(
        layout_map=layout_map(mesh), batch_dim_name="data"
    )


def _mesh_shape(column):
    if column == "jax-model":
        return (4, 2)
    return (TORCH_PROCESSES["torch-model"] // 2, 2)


# ------------------------------------------------------------------- run
def _model_class(door):
    """`model_class(keras_class)` for one run (see `Case.build`)."""

    def model_class(keras_class):
        if door != "mixin":
            return keras_class
        import keras_parallel

        return type(
            f"Distributed{keras_class.__name__}",
            (keras_parallel.DistributedModel, keras_class),
            {},
        )

    return model_class


def _plain(value):
    """History / logs values as floats (lists of floats)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return float(np.asarray(value))


def run(name, column=None, door="mixin"):
    """Trains case `name` once and returns what the test compares.

    Args:
        name: a key of `CASES`.
        column: a column id, or None for one device (plain Keras).
        door: `"mixin"` (`compile(distribution=...)`) or `"callback"`
            (`fit(callbacks=[ShardingCallback(...)])`, evaluate and predict
            given it too).

    Returns:
        A dict: `weights`, `initial` (the weights before training, where
        the model was built), `histories`, `evaluation`, `predictions`,
        `extra`, `split` (the probe's records of the training calls), and
        `get_weights_error`: what `model.get_weights()` raised after all
        that, or None (the weights are read without it, so that the other
        comparisons still run).
    """
    keras = _keras()
    case = CASES[name]
    with case.within() if case.within else contextlib.nullcontext():
        return _run(case, keras, column, door)


def _run(case, keras, column, door):
    import keras_parallel

    policy = keras.config.dtype_policy()
    callbacks = []
    try:
        if case.dtype_policy:
            keras.config.set_dtype_policy(case.dtype_policy)
        dist = None if column is None else distribution(column, case.keras_defaults)
        keras.utils.set_random_seed(SEED)
        model = case.build(_model_class(door if column else "plain"))
        arguments = case.compile()
        if dist is not None and door == "mixin":
            arguments["distribution"] = dist
        elif dist is not None:
            callbacks = [keras_parallel.ShardingCallback(dist)]
        model.compile(**arguments)
        initial = _values(model.weights) if model.built else None
        data = case.data()
        split_probe.clear()
        EAGER_RECORDS.clear()
        keras.utils.set_random_seed(SEED)  # One shuffle for every run.
        histories, extra = case.train(model, data, callbacks)
        split = split_probe.records() + list(EAGER_RECORDS)
        evaluation = model.evaluate(
            data.x,
            data.y,
            batch_size=BATCH,
            verbose=0,
            return_dict=True,
            callbacks=callbacks,
        )
        # Two whole batches: the order of the rows the devices predicted is
        # checked; evaluate covered the uneven batch.
        predictions = model.predict(
            _rows(data.x, 2 * BATCH), batch_size=BATCH, verbose=0, callbacks=callbacks
        )
        try:
            model.get_weights()
            get_weights_error = None
        except Exception as error:  # noqa: BLE001 - compared last, by the test.
            get_weights_error = f"{type(error).__name__}: {error}"
        return {
            "weights": _values(model.weights),
            "get_weights_error": get_weights_error,
            "initial": initial,
            "histories": _plain(histories),
            "evaluation": _plain(evaluation),
            "predictions": keras.tree.map_structure(np.asarray, predictions),
            "extra": keras.tree.map_structure(
                lambda v: v if isinstance(v, np.ndarray) else float(v), extra
            ),
            "split": split,
        }
    finally:
        # An entry point that raised leaves the callback's distribution in
        # force (Keras calls no callback then): the next case must not run
        # under it.
        for callback in callbacks:
            callback.close()
        keras.config.set_dtype_policy(policy)


def _values(variables):
    """The variables' values as NumPy arrays, a torch DTensor's gathered
    whole first (a collective: every rank reads the same variables)."""
    keras = _keras()
    values = []
    for variable in variables:
        value = variable.value
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        values.append(np.array(keras.ops.convert_to_numpy(value)))
    return values


def _rows(x, n):
    """The first `n` rows of an array or of each array of a dict."""
    if isinstance(x, dict):
        return {k: v[:n] for k, v in x.items()}
    return x[:n]


def torch_run(selected):
    """A torch rank's part: `run(name, column, door)` for each selected triple.

    A case that raises is returned as `{"error": traceback}`, so that one
    failing feature does not hide the others.
    """
    results = []
    for name, column, door in selected:
        try:
            results.append(run(name, column, door))
        except Exception:  # noqa: BLE001 - reported to the test, per case.
            results.append({"error": traceback.format_exc()})
    return results


# ------------------------------------------------------------ docs table
def cell(case, column):
    """The docs table's cell of `case` in `column` (footnotes by number),
    with every limit, whichever Keras runs the tests."""
    limit = case.limits.get(column)
    if limit is not None:
        return "no", limit.reason
    if case.step_only:
        return "yes", STEP_ONLY
    if case.doors != DOORS:
        return "compile door", case.door_note
    if column in case.uneven_whole:
        return "yes", case.uneven_whole[column]
    return "yes", None


def features_table():
    """docs/features.md's table: one row per case, one column per backend
    and distribution; footnotes give every reason."""
    headings = ["feature", *(column[3] for column in COLUMNS)]
    lines = [
        "| " + " | ".join(headings) + " |",
        "| " + " | ".join("---" for _ in headings) + " |",
    ]
    notes = []
    for case in CASES.values():
        cells = [case.feature]
        for column in COLUMN_IDS:
            text, note = cell(case, column)
            if note is not None:
                if note not in notes:
                    notes.append(note)
                text = f"{text} ({notes.index(note) + 1})"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for number, note in enumerate(notes, 1):
        lines.append(f"{number}. {note}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "jax")
    print(features_table(), end="")
