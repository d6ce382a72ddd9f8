"""`Auto`: the distribution chosen from the memory each candidate will take.

On JAX (8 simulated devices) the candidates' needs come from XLA's memory
analysis of Keras's own train step compiled for each plan. The tests set
budgets between those needs and check which candidate is chosen, that the
chosen one trains like one device with its batch split, that its prediction
matches the step `fit` really compiled, and that a model nothing fits is
refused before any step, unchanged.
"""

import keras
import numpy as np
import pytest
import split_probe
from builders import max_relative_difference, weights_of

import keras_parallel
from keras_parallel.auto import auto
from keras_parallel.auto import choice as auto_choice
from keras_parallel.keras_seam.model_state import binding_of

BACKEND = keras.backend.backend()
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="Auto predicts on JAX")
FEATURES, HIDDEN, OUTPUTS, BATCH = 64, 512, 64, 64


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def _mlp(probe=False, model_class=Net):
    """An MLP whose kernels are large enough to be split (`shard_min_size`)."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,))
    x = split_probe.probe()(inputs) if probe else inputs
    x = keras.layers.Dense(HIDDEN, activation="relu", name="d1")(x)
    x = keras.layers.Dense(HIDDEN, activation="relu", name="d2")(x)
    return model_class(inputs, keras.layers.Dense(OUTPUTS, name="d3")(x))


def _data(n=4 * BATCH):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.normal(size=(n, OUTPUTS)).astype("float32")
    return x, y


def _compile(model, distribution):
    kwargs = {} if distribution is None else {"distribution": distribution}
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", **kwargs)
    return model


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2GiB", 2 * 2**30),
        ("100MB", 100 * 10**6),
        ("1.5 KiB", 1536),
        ("512", 512),
        (4096, 4096),
    ],
)
def test_sizes_read_decimal_and_binary_units(text, expected):
    assert auto.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["2 parsecs", "", "-1GB", 0, -5, 1.5, None, True])
def test_a_size_that_is_not_one_is_refused_naming_the_argument(bad):
    with pytest.raises(ValueError, match="device_memory.*Received: device_memory="):
        auto.parse_bytes(bad)


@pytest.mark.parametrize("bad", [1, -0.1, "0.1", True])
def test_a_headroom_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError, match="headroom"):
        keras_parallel.Auto(device_memory="1GiB", headroom=bad)


def test_auto_is_refused_where_a_backend_predicts_no_step():
    from keras_parallel.backends import executor_class
    from keras_parallel.backends.base import Executor

    class Silent(Executor):
        backend = "silent"

    with pytest.raises(keras_parallel.ShardingError, match="on the silent backend"):
        auto.check_backend(Silent)
    # Every backend keras_parallel runs on declares what it does for Auto.
    auto.check_backend(executor_class())


def test_the_string_auto_is_auto_and_describe_waits_for_the_first_fit():
    model = _compile(_mlp(), "auto")
    assert isinstance(model.distribution, keras_parallel.Auto)
    assert "chosen at its first fit" in keras_parallel.describe(model)


def test_without_a_budget_a_cpu_is_refused_at_the_first_fit_unchanged():
    model = _compile(_mlp(), keras_parallel.Auto())
    before = weights_of(model)
    x, y = _data()
    with pytest.raises(ValueError, match=r"device_memory=\"2GiB\""):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert max_relative_difference(weights_of(model), before) == 0
    assert binding_of(model).plan is None


@pytest.fixture(scope="module")
def needs():
    """Every candidate's prediction for the MLP at the global batch."""
    if BACKEND != "jax":
        pytest.skip("Auto predicts on JAX")
    from keras_parallel.backends import executor_class

    model = _compile(_mlp(), keras_parallel.DataParallel())
    model.optimizer.build(model.trainable_variables)
    x, y = _data(BATCH)
    unlimited = keras_parallel.Auto(device_memory=2**50)
    choice = auto_choice.choose(
        unlimited,
        model,
        (x, y, None),
        executor_class(),
        keras.distribution.list_devices(),
        predict_all=True,
    )
    return choice.candidates


@jax_only
def test_each_reachable_candidate_is_chosen_at_its_threshold(needs):
    names = [c.name for c in needs]
    assert names[:3] == [
        "DataParallel()",
        'DataParallel(shard="optimizer")',
        'DataParallel(shard="full")',
    ]
    assert any(name.startswith("ModelParallel(mesh=(4, 2)") for name in names)
    reachable = []
    for index, candidate in enumerate(needs):
        earlier = [c.bytes_per_device for c in needs[:index]]
        if all(candidate.bytes_per_device < need for need in earlier):
            reachable.append(candidate)
            # At its need exactly: it fits, and every earlier one does not.
            assert (
                auto_choice.first_fitting(needs, candidate.bytes_per_device)
                is candidate
            )
            # A byte less: a later candidate, or none.
            assert auto_choice.first_fitting(
                needs, candidate.bytes_per_device - 1
            ) is not (candidate)
    # Each of data parallelism's three needs less than the one before.
    assert [c.name for c in reachable[:3]] == names[:3]
    # Sharding moves bytes no plain data parallel step does.
    assert needs[2].bytes_moved != needs[0].bytes_moved


@jax_only
def test_the_chosen_distribution_trains_like_one_device_with_the_split_proven(
    needs, recorded_steps
):
    full = needs[2]  # DataParallel(shard="full")
    budget = (full.bytes_per_device + needs[1].bytes_per_device) // 2
    x, y = _data()
    split_probe.clear()
    model = _compile(
        _mlp(probe=True), keras_parallel.Auto(device_memory=budget, headroom=0)
    )
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    binding = binding_of(model)
    assert binding.choice.chosen.name == full.name
    assert model.distribution is binding.choice.chosen.distribution
    assert model.distribution.shard == "full"
    kernel = next(v for v in binding.plan.variables if v.path == "d2/kernel")
    assert "batch" in kernel.axes  # Split, as shard="full" splits it.
    # The last record is the step fit compiled; those before, the
    # candidates' steps compiled to predict their memory.
    split_probe.assert_divided(split_probe.records()[-1:], BATCH, 8)

    one = _compile(_mlp(probe=True), None)
    one.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_relative_difference(weights_of(model), weights_of(one)) < 1e-4

    # The prediction is the step fit compiled, within a tenth.
    compiled, args = recorded_steps[-1]
    stats = compiled.lower(*args).compile().memory_analysis()
    measured = stats.peak_memory_in_bytes
    predicted = binding.choice.chosen.bytes_per_device
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


@jax_only
def test_through_a_callback_auto_chooses_from_the_first_step_like_one_device(needs):
    # Keras hands a callback the model after it drew the batch it builds the
    # model from: the choice is made from the first step's batch, before it
    # runs, and the step is made again under the chosen plan.
    full = needs[2]  # DataParallel(shard="full")
    budget = (full.bytes_per_device + needs[1].bytes_per_device) // 2
    x, y = _data()
    callback = keras_parallel.ShardingCallback(
        keras_parallel.Auto(device_memory=budget, headroom=0)
    )
    model = _compile(_mlp(probe=True, model_class=keras.Model), None)
    split_probe.clear()
    model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[callback]
    )
    assert callback.binding.choice.chosen.name == full.name
    assert callback.distribution.shard == "full"
    split_probe.assert_divided(split_probe.records()[-1:], BATCH, 8)
    one = _compile(_mlp(probe=True, model_class=keras.Model), None)
    one.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_relative_difference(weights_of(model), weights_of(one)) < 1e-4


def test_through_a_callback_a_model_nothing_fits_is_refused_unchanged():
    model = _compile(_mlp(model_class=keras.Model), None)
    before = weights_of(model)
    x, y = _data()
    callback = keras_parallel.ShardingCallback(keras_parallel.Auto("64KB"))
    with pytest.raises(ValueError, match="No candidate distribution fits"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[callback])
    assert max_relative_difference(weights_of(model), before) == 0
    assert callback.binding.plan is None
    # Nothing left in force (the exact backups, the scopes), though Keras
    # calls no callback after the step raised.
    assert callback.binding.run is None
    # The callback's next run puts back the steps the raised one left: after
    # it (refused alike) and `close()`, the model has its own steps again.
    with pytest.raises(ValueError, match="No candidate distribution fits"):
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[callback])
    callback.close()
    assert model.train_function is None  # Never made by a plain `fit`.
    assert callback.binding.run is None


def test_a_model_nothing_fits_is_refused_before_any_step_unchanged():
    model = _compile(_mlp(), keras_parallel.Auto(device_memory="64KB"))
    before = weights_of(model)
    steps = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            steps.append(batch)

    x, y = _data()
    with pytest.raises(ValueError, match="No candidate distribution fits") as error:
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[Count()])
    message = str(error.value)
    assert "the smallest need is" in message
    assert "56.2 KiB per device" in message  # 64 kB (64000 bytes) less a tenth.
    assert "largest variable is d2/kernel" in message
    assert steps == []
    assert max_relative_difference(weights_of(model), before) == 0
    assert binding_of(model).plan is None


@jax_only
@pytest.mark.parametrize(
    "line,expected",
    [
        # An all-reduce of 1 MiB over 8 devices: 2 (n-1)/n of it.
        (
            "%a = f32[512,512]{1,0} all-reduce(%x), replica_groups={{0,1,2,3,4,5,6,7}}",
            2 * 2**20 * 7 // 8,
        ),
        # An all-gather over 4 of 2 groups (iota form): (n-1)/n of its result.
        (
            "%g = f32[1024,512]{1,0} all-gather(%p), replica_groups=[2,4]<=[4,2]",
            2**21 * 3 // 4,
        ),
        # A reduce-scatter to 1 KiB over a mesh axis of 2: its input, half.
        (
            "%r = f32[256]{0} reduce-scatter(%p), replica_groups=mesh['data'=4,'model'=2] {'model'}",
            1024,
        ),
        # Async start ops count, their done ops do not.
        ("%s = (f32[8], f32[8]) all-reduce-start(%p, %q), replica_groups={{0,1}}", 64),
        ("%d = f32[8] all-reduce-done(%s)", 0),
        ("%f = f32[8] fusion(%p), kind=kLoop", 0),
    ],
)
def test_bytes_moved_count_what_a_ring_sends(line, expected):
    from keras_parallel.backends.jax.step_memory import moved_bytes

    assert moved_bytes(line, 8) == expected


@jax_only
def test_a_kerashub_llama_trains_as_chosen_like_one_device(recorded_steps):
    # Under the budget of its first reachable candidate after plain data
    # parallelism: a sharded plan, proven split, equal to one device, and
    # predicted within a tenth of the step fit compiled.
    import hub_models

    hub_models.require()
    from keras_parallel.backends import executor_class

    x, y = hub_models.batch("llama", 16)

    def llama(distribution):
        model = hub_models.model("llama", probe=True, model_class=Net)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", distribution=distribution
        )
        return model

    probe = llama(keras_parallel.DataParallel())
    probe.optimizer.build(probe.trainable_variables)

    def chosen_under(budget):
        # Predicted in order until one fits: a few compilations, not nine.
        return auto_choice.choose(
            keras_parallel.Auto(device_memory=budget, headroom=0),
            probe,
            (x, y, None),
            executor_class(),
            keras.distribution.list_devices(),
        ).chosen

    plain = chosen_under(2**50)
    assert plain.name == "DataParallel()"
    second = chosen_under(plain.bytes_per_device - 1)  # The next that needs less.
    split_probe.clear()
    model = llama(
        keras_parallel.Auto(device_memory=second.bytes_per_device, headroom=0)
    )
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    chosen = binding_of(model).choice.chosen
    assert chosen.name == second.name
    split_probe.assert_divided(split_probe.records()[-1:], 16, 8)
    compiled, args = recorded_steps[-1]
    measured = compiled.lower(*args).compile().memory_analysis().peak_memory_in_bytes
    assert abs(chosen.bytes_per_device - measured) <= 0.1 * measured

    one = llama(None)
    one.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_relative_difference(weights_of(model), weights_of(one)) < 1e-4


@pytest.mark.parametrize("door", ["model", "callback"])
def test_every_run_is_made_for_the_chosen_distribution(door, monkeypatch):
    # `Auto` chooses in a step of its own: no run begins before the choice,
    # and each run holds the chosen distribution's executor from its entry
    # to its exit (none is swapped inside a run).
    from keras_parallel.run.run import Run

    seen = []
    enter, leave = Run.__enter__, Run.__exit__

    def entered(run):
        seen.append(("enter", run.binding.executor, run.binding.choice))
        return enter(run)

    def left(run, *error):
        seen.append(("exit", run.binding.executor, run.binding.choice))
        return leave(run, *error)

    monkeypatch.setattr(Run, "__enter__", entered)
    monkeypatch.setattr(Run, "__exit__", left)
    auto_ = keras_parallel.Auto(device_memory="1GiB")
    x, y = _data()
    if door == "model":
        model = _compile(_mlp(), auto_)
        callbacks = []
    else:
        model = _compile(_mlp(model_class=keras.Model), None)
        callbacks = [keras_parallel.ShardingCallback(auto_)]
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
    model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks)
    assert auto_.choice is not None
    chosen = auto_.choice.chosen.distribution
    assert seen and all(choice is auto_.choice for _, _, choice in seen)
    executors = {id(executor) for _, executor, _ in seen if executor is not None}
    assert all(executor is not None for _, executor, _ in seen)
    assert len(executors) == 1
    assert seen[0][1].distribution is chosen
    assert [kind for kind, _, _ in seen].count("enter") >= 2


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TensorFlow needs no batch")
def test_a_model_built_whole_is_chosen_for_the_batch_keras_would_not_draw():
    # Keras draws no batch to build a model whose variables, loss, metrics
    # and optimizer are built: the model door draws it as Keras would.
    model = _compile(_mlp(), keras_parallel.Auto(device_memory="1GiB"))
    x, y = _data()
    keras.Model._symbolic_build(model, data_batch=(x[:BATCH], y[:BATCH], None))
    model.optimizer.build(model.trainable_variables)
    model.fit(x, y, batch_size=BATCH // 2, epochs=1, verbose=0)
    assert binding_of(model).choice.batch == f"{BATCH // 2} rows"


@jax_only
def test_a_saved_model_keeps_what_auto_chose(needs, tmp_path):
    budget = needs[1].bytes_per_device  # DataParallel(shard="optimizer")'s.
    model = _compile(_mlp(), keras_parallel.Auto(device_memory=budget, headroom=0))
    path = str(tmp_path / "unchosen.keras")
    model.save(path)  # Before the choice: no distribution saved.
    loaded = keras.saving.load_model(path, custom_objects={"Net": Net})
    assert loaded.distribution is None
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    path = str(tmp_path / "chosen.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"Net": Net})
    assert isinstance(loaded.distribution, keras_parallel.DataParallel)
    assert loaded.distribution.shard == "optimizer"


@pytest.mark.skipif(
    BACKEND == "tensorflow",
    reason="TensorFlow's choice needs no batch: its predict chooses (below)",
)
@pytest.mark.parametrize(
    "door,entry_point",
    [("model", "predict"), ("model", "predict_on_batch"), ("callback", "predict")],
)
def test_a_prediction_before_the_choice_is_refused(door, entry_point):
    auto_ = keras_parallel.Auto(device_memory="1GiB")
    x, _ = _data(BATCH)
    if door == "model":
        model = _compile(_mlp(), auto_)
        binding = binding_of(model)
        call = getattr(model, entry_point)
    else:
        model = _compile(_mlp(model_class=keras.Model), None)
        callback = keras_parallel.ShardingCallback(auto_)
        binding = callback.binding

        def call(x):
            return model.predict(x, verbose=0, callbacks=[callback])

    with pytest.raises(ValueError, match=f"{entry_point}\\(\\) before any fit"):
        call(x)
    assert binding.plan is None
    assert binding.run is None  # Nothing left in force.


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow needs no batch")
def test_tensorflow_predict_first_chooses():
    model = _compile(_mlp(), keras_parallel.Auto(device_memory="1GiB"))
    x, _ = _data(BATCH)
    model.predict(x, verbose=0)
    assert isinstance(model.distribution, keras_parallel.DataParallel)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow chooses at entry")
def test_tensorflow_refuses_auto_for_an_unbuilt_model_before_anything_runs():
    class Subclassed(keras_parallel.DistributedModel, keras.Model):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(OUTPUTS)

        def call(self, x):
            return self.d1(x)

    model = _compile(Subclassed(), keras_parallel.Auto(device_memory="1GiB"))
    x, y = _data()
    with pytest.raises(ValueError, match="model.build\\(input_shape\\)"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert not model.built  # Nothing ran.
    assert binding_of(model).run is None


# ---------------------------------------------------------------- TensorFlow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's one candidate")
@pytest.mark.parametrize("door", ["model", "callback"])
def test_tensorflow_chooses_data_parallelism_and_says_why(door):
    import tensorflow as tf

    devices = len(tf.config.list_logical_devices("CPU"))
    x, y = _data()
    split_probe.clear()
    auto_ = keras_parallel.Auto(device_memory="1GiB")
    if door == "model":
        model = _compile(_mlp(probe=True), auto_)
        callbacks = []
    else:
        model = _compile(_mlp(probe=True, model_class=keras.Model), None)
        callbacks = [keras_parallel.ShardingCallback(auto_)]
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
    )
    choice = auto_.choice
    assert [c.name for c in choice.candidates] == ["DataParallel()"]
    assert isinstance(choice.chosen.distribution, keras_parallel.DataParallel)
    assert "data parallelism is the one candidate" in choice.table()
    # The state and its gradients, exact: the MLP's variables, Adam's two
    # slots and a gradient per trainable variable, each once per replica.
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert choice.chosen.bytes_per_device >= 4 * 4 * parameters
    split_probe.assert_divided(split_probe.records(), BATCH, devices)
    one = _compile(_mlp(probe=True, model_class=keras.Model), None)
    one.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert max_relative_difference(weights_of(model), weights_of(one)) < 1e-4


# --------------------------------------------------------------------- torch
@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def torch_ranks(request):
    """`auto_torch_workers.auto_ranks` in 2 and 4 gloo processes."""
    if BACKEND != "torch":
        pytest.skip("torch ranks")
    import hub_models

    hub_models.require()
    import auto_torch_workers
    from torch_launch import launch

    ranks = launch(
        auto_torch_workers.auto_ranks,
        request.param,
        timeout=400,
        collective_timeout=60,
    )
    for rank in ranks:
        for name, result in rank.items():
            assert "error" not in result, (name, result["error"])
    return request.param, ranks


@pytest.fixture(scope="module")
def torch_one_device():
    import auto_torch_workers as workers

    return {
        name: workers.trained(
            name, workers.compiled(workers.model(name, keras.Model, probe=True))
        )
        for name in ("mlp", "llama")
    }


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_torch_each_reachable_candidate_is_chosen_at_its_threshold(torch_ranks, name):
    processes, ranks = torch_ranks
    needs = ranks[0][name]["needs"]
    assert [n for n, _, _ in needs[:3]] == [
        "DataParallel()",
        'DataParallel(shard="optimizer")',
        'DataParallel(shard="full")',
    ]
    assert any(n.startswith("ModelParallel(mesh=(1, ") for n, _, _ in needs)
    thresholds = ranks[0][name]["thresholds"]
    # Each of data parallelism's three needs less than the one before.
    assert [t[0] for t in thresholds[:3]] == [n for n, _, _ in needs[:3]]
    for candidate, _need, at_need, below in thresholds:
        assert at_need == candidate  # At its need exactly: it is chosen.
        assert below != candidate  # A byte less: a later one, or none.


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_torch_the_chosen_distribution_trains_like_one_device_split(
    torch_ranks, torch_one_device, name
):
    import auto_torch_workers as workers

    processes, ranks = torch_ranks
    # Every rank applies process 0's choice: the first candidate of the
    # table `fit` printed whose need fits the budget. `fit` measures the
    # step anew, and the measurement moves with the garbage collector (a
    # few %), so the choice is read against `fit`'s own table; the exact
    # thresholds are `test_torch_each_reachable_candidate_is_chosen_at_its_threshold`'s.
    chosen = {rank[name]["chosen"] for rank in ranks}
    assert chosen == {ranks[0][name]["first_fitting"]}, ranks[0][name]["needs"]
    # A budget below plain data parallelism's need: a sharded plan chosen.
    chosen_name = chosen.pop()
    assert chosen_name != "DataParallel()"
    # The chosen sharding is in force: each rank holds parts of the
    # variables where the plan splits them (`_held_in_part` finds none
    # under `shard="optimizer"` on these models).
    if chosen_name != 'DataParallel(shard="optimizer")':
        assert all(rank[name]["held"] for rank in ranks)
    data_ways = processes
    if chosen_name.startswith("ModelParallel(mesh=("):
        data_ways = int(chosen_name.split("(")[2].split(",")[0])
    runs = [rank[name] for rank in ranks]
    if name == "mlp":  # And through a `ShardingCallback`, chosen alike.
        runs += [rank["callback"] for rank in ranks]
        assert {rank["callback"]["chosen"] for rank in ranks} == {
            ranks[0]["callback"]["first_fitting"]
        }
        assert ranks[0]["callback"]["chosen"] != "DataParallel()"
        if ranks[0]["callback"]["chosen"] != 'DataParallel(shard="optimizer")':
            assert all(rank["callback"]["held"] for rank in ranks)
    for run in runs:
        # The two steps `fit` ran are the last records; before them, Keras's
        # build (eager, for the Llama) and the step `Auto` measured.
        split_probe.assert_divided(run["split"][-2:], workers.BATCH[name], data_ways)
        assert max_relative_difference(run["weights"], torch_one_device[name]) < 1e-4


def test_torch_a_budget_nothing_fits_is_refused_on_every_rank_unchanged(torch_ranks):
    # Process 0 predicts and refuses; every other rank raises the same error
    # (sent as JSON), and no rank's weights moved.
    processes, ranks = torch_ranks
    messages = [rank["refused"]["message"] for rank in ranks]
    assert "No candidate distribution fits" in messages[0]
    for message in messages[1:]:
        assert message == f"(process 0 chose) {messages[0]}"
    assert all(rank["refused"]["unchanged"] for rank in ranks)
