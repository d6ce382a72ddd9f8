"""What the divided-input tests run in every process: counted pipelines.

Each input kind is a pipeline that counts the rows this process prepared
(a map-style `Dataset` counts its `__getitem__` calls; arrays count none,
Keras slices them), fits, validates, evaluates and predicts a small model
through it, and returns the count with what a test compares with one
device.
"""

import os

import numpy as np
import split_probe
import torch_workers

from keras_parallel.keras_seam.model_state import state_of

EPOCHS = 2
ROWS = 1003  # 16 batches of 64, the last of 43: an uneven last batch.
BATCH = 64


class Counted:
    """A map-style dataset over arrays, counting the rows it loads.

    Any object with `__getitem__` and `__len__` is a map-style dataset to
    a torch `DataLoader`; defined here so that worker processes can import
    it (and without importing torch, which the other envs lack).
    """

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.loaded = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        import torch

        self.loaded += 1
        return torch.as_tensor(self.x[i]), torch.as_tensor(self.y[i])


class CountedBatches:
    """A `keras.utils.PyDataset` over arrays, counting the rows it makes
    (made lazily: Keras is imported in the process that runs it)."""

    def __new__(cls, x, y, workers=1):
        import keras

        class Batches(keras.utils.PyDataset):
            made = 0

            def __init__(self):
                super().__init__(workers=workers)

            def __len__(self):
                return -(-len(x) // BATCH)

            def __getitem__(self, i):
                s = slice(i * BATCH, (i + 1) * BATCH)
                Batches.made += len(x[s])
                return x[s], y[s]

        return Batches()


class CountedGenerator:
    """An endless generator of batches over arrays, counting the rows drawn."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.drawn = 0

    def __iter__(self):
        while True:
            for start in range(0, len(self.x), BATCH):
                rows = slice(start, start + BATCH)
                self.drawn += len(self.x[rows])
                yield self.x[rows], self.y[rows]


class CountedMap:
    """A row-wise `tf.data` map that counts the rows it maps (in Python,
    through `tf.py_function`), leaving them as they are."""

    def __init__(self):
        self.mapped = 0

    def __call__(self, x, y):
        import tensorflow as tf

        def count():
            self.mapped += 1
            return np.float32(0)

        zero = tf.reshape(tf.py_function(count, [], tf.float32), [])
        return x + zero, y


def counted_pipeline(x, y, shuffle):
    """A `tf.data` pipeline as the guide writes it, and its counting map:
    slices, a seeded shuffle, a map, a batch, a prefetch."""
    import tensorflow as tf

    counted = CountedMap()
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        dataset = dataset.shuffle(len(x), seed=5)
    dataset = dataset.map(counted).batch(BATCH).prefetch(2)
    return dataset, counted


def run(kind, distributed=True, num_workers=0, shuffle=True, torch_seed=0):
    """Fits, evaluates and predicts through one kind of input.

    Args:
        kind: `"arrays"`, `"dataloader"` (shuffled, over a counted
            map-style dataset; validation through another), `"pydataset"`,
            `"generator"` or `"tfdata"` (a shuffled `tf.data` pipeline with
            a counted map; validation through another).
        distributed: False for the one-device reference.
        num_workers: the loader's worker processes (the PyDataset's
            worker threads).
        shuffle: `fit`'s shuffle of arrays and of a PyDataset.
        torch_seed: torch's seed in this process (a loader shuffles with
            it); every process must shuffle as process 0.

    Returns:
        A dict: `loaded` (rows this process's pipeline prepared), weights,
        history, evaluation, predictions, the probe's records and the
        input kinds the steps divided.
    """
    import keras

    import keras_parallel

    try:
        import torch
    except ImportError:  # The JAX env may lack torch: no DataLoader then.
        torch = None
    x, y = torch_workers.make_data(ROWS)
    model = torch_workers.make_model(distributed=False)
    torch_workers._compile(model)
    callbacks = []
    if distributed:
        callbacks.append(keras_parallel.ShardingCallback(keras_parallel.DataParallel()))
    if torch is not None:
        torch.manual_seed(torch_seed)  # The loader's shuffle: process 0's counts.
    train = validation = None
    if kind == "dataloader":
        train = Counted(x, y)
        validation = Counted(x[:301], y[:301])
        loader = torch.utils.data.DataLoader(
            train, batch_size=BATCH, shuffle=True, num_workers=num_workers
        )
        inputs = {"x": loader}
        inputs["validation_data"] = torch.utils.data.DataLoader(
            validation, batch_size=BATCH, num_workers=num_workers
        )
    elif kind == "pydataset":
        train = CountedBatches(x, y, workers=max(1, num_workers))
        inputs = {"x": train, "shuffle": shuffle, "validation_data": (x[:301], y[:301])}
    elif kind == "tfdata":
        dataset, train = counted_pipeline(x, y, shuffle=True)
        inputs = {"x": dataset, "shuffle": False}  # The pipeline shuffles.
        inputs["validation_data"], validation = counted_pipeline(
            x[:301], y[:301], shuffle=False
        )
    elif kind == "generator":
        train = CountedGenerator(x, y)
        inputs = {"x": iter(train), "steps_per_epoch": 16}
        inputs["validation_data"] = (x[:301], y[:301])
    else:
        inputs = {"x": x, "y": y, "batch_size": BATCH, "shuffle": True}
        inputs["validation_data"] = (x[:301], y[:301])
    split_probe.clear()
    history = model.fit(**inputs, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    split = split_probe.records()
    # Evaluate and predict read the same kind of input, unshuffled.
    evaluation, predictions, counted = evaluate_and_predict(
        model, kind, x, y, callbacks[:1], num_workers
    )
    return {
        "rank": process_index(),
        "loaded": _loaded(kind, train, validation),
        "loaded_after_fit": counted(),
        "weights": [np.asarray(w) for w in model.get_weights()],
        "history": {k: list(map(float, v)) for k, v in history.history.items()},
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "predictions": np.asarray(predictions),
        "split": split,
        "divided": _divided_kinds(model),
        "keras": keras.version(),
    }


def evaluate_and_predict(model, kind, x, y, callbacks, num_workers=0):
    """`model.evaluate` and `model.predict` of all the rows through `kind`.

    Returns:
        `(evaluation, predictions, counted)`: `counted()` is the rows the
        inputs prepared (None for arrays).
    """
    if kind == "arrays" or (kind == "pydataset" and num_workers > 1):
        # A PyDataset of several workers is read whole, as `fit` read it.
        inputs = [dict(x=x, y=y, batch_size=BATCH), dict(x=x[:203], batch_size=BATCH)]
        counted = None
    elif kind == "dataloader":
        import torch

        made = [Counted(x, y), Counted(x, y)]
        inputs = [
            dict(x=torch.utils.data.DataLoader(d, BATCH, num_workers=num_workers))
            for d in made
        ]
        counted = [lambda d=d: d.loaded for d in made]
    elif kind == "pydataset":
        made = [CountedBatches(x, y), CountedBatches(x, y)]
        inputs = [dict(x=d) for d in made]
        counted = [lambda d=d: type(d).made for d in made]
    elif kind == "generator":
        made = [CountedGenerator(x, y), CountedGenerator(x, y)]
        inputs = [dict(x=iter(d), steps=16) for d in made]
        counted = [lambda d=d: d.drawn for d in made]
    else:
        made = [counted_pipeline(x, y, shuffle=False) for _ in range(2)]
        inputs = [dict(x=dataset) for dataset, _ in made]
        counted = [lambda m=m: m.mapped for _, m in made]
    evaluation = model.evaluate(
        **inputs[0], verbose=0, return_dict=True, callbacks=callbacks
    )
    predictions = model.predict(**inputs[1], verbose=0, callbacks=callbacks)
    if counted is None:
        return evaluation, predictions, lambda: None
    return evaluation, predictions, lambda: [count() for count in counted]


def process_index():
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.process_index()
    if keras.backend.backend() == "tensorflow":
        from keras_parallel.backends.tensorflow import workers

        strategy = workers.strategy()
        return 0 if strategy is None else strategy.worker_index
    return int(os.environ.get("RANK", "0"))


def _divided_kinds(model):
    """The input kinds seen, and whether each was divided (`{}` alone)."""
    binding = state_of(model).callback_binding
    if binding is None:
        return {}
    executor = binding.executor
    divided = getattr(executor, "divided_input", None)
    if divided is None:
        divided = executor._steps.divided_input
    return dict(divided.kinds)


def assert_trained_as_one_device(result, reference):
    """Weights, History, evaluation and predictions equal one device's."""
    for a, b in zip(result["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key, values in reference["history"].items():
        np.testing.assert_allclose(result["history"][key], values, rtol=1e-5)
    for key, value in reference["evaluation"].items():
        np.testing.assert_allclose(result["evaluation"][key], value, rtol=1e-5)
    np.testing.assert_allclose(
        result["predictions"], reference["predictions"], rtol=1e-5, atol=1e-6
    )


def assert_crafted_batch_refused(result, out, name):
    """The launch of `crafted_batch_reaches_process_1` failed on process 1
    (`name`: "process", "worker") with the store's refusal naming the key,
    and the crafted payload never ran (no `OUT/ran`)."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert "UntrustedValueError" in result.stderr, result.stderr[-3000:]
    assert "'keras_parallel/input/0/0/1'" in result.stderr
    assert "does not carry this run's tag" in result.stderr
    assert f"{name} 1 failed" in result.stderr
    assert not (out / "ran").exists()


def assert_divided_after_fit(results, reference, kind):
    """Each process prepared about its share of `evaluate`'s and `predict`'s
    input (the 1003 rows once each on one device, and on TensorFlow the
    batches Keras reads first for the element spec, in every process):
    at most half and a batch, or (a generator) process 0 all of it and the
    others only the 2 batches Keras peeks. A generator's prefetch may run up
    to 4 batches ahead under load, drawn and dropped when the call ends (3
    seen in CI on process 0, 4 on one device): process 0 is bounded by the
    rows, not by one device's count; the others' count is the split's
    proof."""
    counts = [result["loaded_after_fit"] for result in results]
    ahead = 4 * BATCH if kind == "generator" else 0
    for call, alone in enumerate(reference["loaded_after_fit"]):
        spec = alone - ROWS  # Drawn for the element spec (TensorFlow).
        assert 0 <= spec <= 2 * BATCH + ahead, reference["loaded_after_fit"]
        assert spec % BATCH == 0, reference["loaded_after_fit"]
        for process, per_call in enumerate(counts):
            if kind == "generator" and process == 0:
                assert ROWS <= per_call[call] <= ROWS + 2 * BATCH + ahead, counts
            elif kind == "generator":
                assert per_call[call] <= 2 * BATCH, counts
            else:
                assert per_call[call] <= spec + ROWS / 2 + BATCH, counts


def run_all(cases):
    return [run(**case) for case in cases]


def _loaded(kind, train, validation):
    if kind == "dataloader":
        return train.loaded + validation.loaded
    if kind == "pydataset":
        return type(train).made
    if kind == "generator":
        return train.drawn
    if kind == "tfdata":
        return train.mapped + validation.mapped
    return None


def pipeline_fails_on_rank_1():
    """A PyDataset whose batch 3 (made by rank 1 alone, round-robin: the
    first two are also made by every TensorFlow worker for Keras's element
    spec) raises."""
    import keras

    import keras_parallel

    x, y = torch_workers.make_data(256)

    class Failing(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 3:
                raise RuntimeError("batch 3 could not be decoded")
            return x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    model = torch_workers.make_model(distributed=False)
    torch_workers._compile(model)
    door = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    model.fit(Failing(), epochs=1, verbose=0, shuffle=False, callbacks=[door])


class _OpensFile:
    """Unpickled, it creates a file: a payload that would run code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted_batch_reaches_process_1(marker):
    """A generator's `fit` on 2 JAX processes or TensorFlow workers, where
    the payload under the key process 1 takes the first batch from is a
    crafted pickle (as any host that reaches the coordination service could
    write there, without the run's secret): on process 0 the store's write
    of that key is replaced by it."""
    import base64
    import pickle

    import keras

    import keras_parallel
    from keras_parallel.input import transport

    target = transport.batch_key(0, 0) + "/1"  # The first generator run's.
    crafted = pickle.dumps(_OpensFile(marker))
    if process_index() == 0 and keras.backend.backend() == "jax":
        from keras_parallel.backends.jax import processes

        put_bytes = processes.CoordinationStore.put_bytes

        def intruded(store, key, payload):
            put_bytes(store, key, crafted if key == target else payload)

        processes.CoordinationStore.put_bytes = intruded
    elif process_index() == 0:
        from keras_parallel.backends.tensorflow import workers

        set_value = workers.CoordinationStore.set

        def intruded(store, key, value):
            if key == target:  # TensorFlow's values are strings: base64.
                value = base64.b64encode(crafted).decode("ascii")
            set_value(store, key, value)

        workers.CoordinationStore.set = intruded

    x, y = torch_workers.make_data(256)

    def batches():
        for i in range(0, 256, BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]

    model = torch_workers.make_model(distributed=False)
    torch_workers._compile(model)
    door = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    model.fit(batches(), epochs=1, verbose=0, callbacks=[door])
