"""Models that once stopped behaving like Keras under the doors, run alike.

Each scenario builds a model the way Keras's own tests do (frozen, partly
frozen, an output without a loss, a loss from `add_loss` alone), trains,
evaluates and predicts it with the default `verbose`, and returns what a
test compares with one device: weights, History, evaluation, predictions
and the rows each step of this process computed (`split_probe`). It runs in
every process of a launch (torch ranks) or in the test's own (JAX,
TensorFlow), and with `distributed=False` as the one-device reference.
"""

import numpy as np
import split_probe

SCENARIOS = ("frozen", "partly_frozen", "loss_none", "add_loss_only")


def _keras():
    import keras

    return keras


def _rank():
    keras = _keras()
    if keras.backend.backend() != "torch":
        return 0
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def data(n=48, features=6):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def build(scenario, seed=3):
    """The scenario's compiled plain `keras.Model`.

    Args:
        scenario: one of `SCENARIOS`.
        seed: the initial weights' seed (other per rank: a broadcast of
            rank 0's must make them one model).
    """
    keras = _keras()
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = split_probe.probe()(inputs)
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")
    x = hidden(x)
    loss = "mse"
    if scenario == "loss_none":
        outputs = [
            keras.layers.Dense(2, name="out")(x),
            keras.layers.Dense(3, name="unused")(x),
        ]
        loss = ["mse", None]
    elif scenario == "add_loss_only":
        # Keras's `test_internal_only_loss`: the last layer gets no gradient.

        class LossLayer(keras.layers.Layer):
            def call(self, v):
                self.add_loss(keras.ops.mean(v**2))
                return v

        outputs = keras.layers.Dense(2, name="out")(LossLayer()(x))
        loss = None
    else:
        outputs = keras.layers.Dense(2, name="out")(x)
    model = keras.Model(inputs, outputs)
    if scenario == "frozen":
        model.trainable = False
    if scenario == "partly_frozen":
        hidden.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    return model


def run(scenario, door="model", distributed=True, seed_by_rank=False):
    """Fit, evaluate and predict `scenario` through one door.

    Args:
        scenario: one of `SCENARIOS`.
        door: `"model"` (a `DistributedModel` subclass of the same graph)
            or `"callback"` (`ShardingCallback` on every call).
        distributed: False for the one-device reference.
        seed_by_rank: each rank builds other initial weights.

    Returns:
        A dict of NumPy values and the probe's records.
    """
    keras = _keras()
    import keras_parallel

    rank = _rank() if distributed else 0
    model = build(scenario, seed=3 + (rank if seed_by_rank else 0))
    if distributed and door == "model":

        class Net(keras_parallel.DistributedModel, keras.Model):
            pass

        model = Net(model.inputs, model.outputs)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=build(scenario).loss,
            distribution=keras_parallel.DataParallel(),
        )
    x, y = data()
    targets = [y, y] if scenario == "loss_none" else y

    def doors():
        if distributed and door == "callback":
            return [keras_parallel.ShardingCallback(keras_parallel.DataParallel())]
        return []

    split_probe.clear()
    # The default `verbose` everywhere: every rank runs the progress bar's
    # hooks (silenced but on rank 0).
    history = model.fit(
        x, targets, batch_size=16, epochs=2, shuffle=False, callbacks=doors()
    )
    evaluated = model.evaluate(x, targets, batch_size=16, callbacks=doors())
    predicted = model.predict(x, batch_size=16, callbacks=doors())
    return {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "history": {k: list(map(float, v)) for k, v in history.history.items()},
        "evaluated": np.asarray(evaluated, dtype="float64").tolist(),
        "predicted": [np.asarray(p) for p in keras.tree.flatten(predicted)],
        "records": split_probe.records(),
    }


def run_all(cases):
    """`run(**case)` for each case, in one launch."""
    return [run(**case) for case in cases]


def fails_in_a_callback_on_rank_1():
    """Rank 1 raises in a callback while `evaluate` ends; rank 0 goes on to
    `predict`, whose first collective then breaks."""
    keras = _keras()
    import keras_parallel

    class Fails(keras.callbacks.Callback):
        def on_test_end(self, logs=None):
            if _rank() == 1:
                raise RuntimeError("rank 1's own callback failed")

    model = build("partly_frozen")
    x, y = data()
    door = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[door, Fails()])
    door = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    model.predict(x, batch_size=16, verbose=0, callbacks=[door])
