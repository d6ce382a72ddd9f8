"""`Run`: one object per entry point owns what is in force, and undoes it.

Each test names one promise of `keras_parallel/run/run.py`: the plan applied
before Keras makes its step (never from inside `make_*_function`), one run
for an entry point with the ones nested in it, the parts left in reverse
order with the error that unwinds, and both doors making the same run.
"""

import keras
import model_forms
import pytest
from builders import dense_model, regression_data

import keras_parallel
from keras_parallel.keras_seam.model_state import binding_of
from keras_parallel.run import run as run_module
from keras_parallel.run.run import Run


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def _unbuilt():
    """A subclassed model, unbuilt until Keras builds it inside its entry point."""
    return model_forms.build("subclassed", "mixin")


def _compiled(model):
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    return model


@pytest.fixture
def runs(monkeypatch):
    """Every `Run` made while the test runs, in order."""
    made = []
    keras_init = Run.__init__

    def recording(self, *args, **kwargs):
        keras_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Run, "__init__", recording)
    return made


def _plan_versions_at_make(model, monkeypatch):
    """`[(kind, plan version when Keras asks for the step, after)]`."""
    seen = []
    binding = binding_of(model)
    for kind in ("train", "test", "predict"):
        name = f"make_{kind}_function"
        own = getattr(model, name)

        def make(force=False, own=own, kind=kind):
            before = binding.version if binding.plan is not None else None
            result = own(force=force)
            seen.append((kind, before, binding.version))
            return result

        monkeypatch.setattr(model, name, make)
    return seen


@pytest.mark.parametrize(
    "entry_point", ["fit", "evaluate", "predict", "train_on_batch", "test_on_batch"]
)
def test_an_unbuilt_model_is_planned_before_keras_makes_its_step(
    entry_point, monkeypatch
):
    x, y = model_forms.data(64)
    model = _compiled(_unbuilt())
    assert binding_of(model).plan is None  # Unbuilt: nothing to plan yet.
    seen = _plan_versions_at_make(model, monkeypatch)
    calls = {
        "fit": lambda: model.fit(x, y, batch_size=16, verbose=0),
        "evaluate": lambda: model.evaluate(x, y, batch_size=16, verbose=0),
        "predict": lambda: model.predict(x, batch_size=16, verbose=0),
        "train_on_batch": lambda: model.train_on_batch(x[:16], y[:16]),
        "test_on_batch": lambda: model.test_on_batch(x[:16], y[:16]),
    }
    calls[entry_point]()
    if entry_point == "predict" and keras.backend.backend() == "torch":
        # torch's `predict` makes the step before it builds the model,
        # inside its first step: planned there, then made again
        # (`Binding._planned_at_first_step`).
        assert seen[0][1] is None
        seen = seen[1:]
    elif entry_point == "predict" and keras.backend.backend() == "tensorflow":
        # TensorFlow's `predict` makes its step, then builds the model from
        # the data's spec under the strategy the run attached, before any
        # step is traced: its variables are born mirrored, nothing to move
        # (`element_spec_build.late_distribution`; the split is proven in
        # test_first_call.py). The next entry point applies the plan.
        assert seen == [("predict", None, 0)]
        model.predict(x, batch_size=16, verbose=0)
        assert binding_of(model).plan is not None
        return
    assert seen, "Keras made no step function"
    for kind, before, after in seen:
        # Planned when Keras asked for the step, and not planned anew by it.
        assert before is not None, f"{kind} step made before any plan"
        assert before == after, f"a plan was applied inside make_{kind}_function"


def test_an_evaluation_inside_fit_runs_in_the_fit_run(runs):
    x, y = regression_data(64)
    model = _compiled(dense_model(Net))
    model.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=0)
    assert len(runs) == 1
    assert binding_of(model).run is None


def test_each_entry_point_is_one_run_through_the_model_door(runs):
    x, y = regression_data(32)
    model = _compiled(dense_model(Net))
    model.fit(x, y, batch_size=16, verbose=0)
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    model.train_on_batch(x[:16], y[:16])
    model.test_on_batch(x[:16], y[:16])
    model.predict_on_batch(x[:16])
    assert len(runs) == 6
    assert {r.binding for r in runs} == {binding_of(model)}


def test_the_callback_door_makes_the_same_run():
    x, y = regression_data(32)
    model = dense_model(keras.Model)
    model.compile(optimizer="sgd", loss="mse")
    callback = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    seen = []

    class InRun(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(type(callback.binding.run))

    model.fit(x, y, batch_size=16, verbose=0, callbacks=[callback, InRun()])
    assert seen and set(seen) == {Run}
    assert callback.binding.run is None  # Ended with the run's callbacks.


def test_parts_are_left_in_reverse_order_with_the_error(monkeypatch):
    x, y = regression_data(64)
    model = _compiled(dense_model(Net))
    events = []

    def recorded(name):
        def scope(model):
            return _Recorder(name, events)

        return scope

    executor = binding_of(model).executor
    monkeypatch.setattr(executor, "scope", recorded("scope"))
    monkeypatch.setattr(executor, "planned_scope", recorded("planned"))

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[Boom()])
    assert events == [
        ("enter", "scope", None),
        ("enter", "planned", None),
        ("exit", "planned", ValueError),
        ("exit", "scope", ValueError),
    ]
    assert binding_of(model).run is None


def test_a_run_inside_a_run_of_the_same_binding_is_refused():
    model = _compiled(dense_model(Net))
    with Run(binding_of(model), model):
        with pytest.raises(RuntimeError, match="already in force"):
            Run(binding_of(model), model).__enter__()
    assert binding_of(model).run is None


def test_a_plan_that_fails_inside_a_run_leaves_every_part(monkeypatch):
    # The model is built inside the run; its plan is refused there.
    x, y = model_forms.data(32)
    model = _compiled(_unbuilt())
    left = []
    handlers_before = len(run_module.callback_lists._handlers)

    def refused(model):
        raise keras_parallel.ShardingError("refused plan")

    monkeypatch.setattr(binding_of(model), "resolve", refused)
    real_scope = binding_of(model).executor.scope

    def scope(model):
        left.append("scope entered")
        return real_scope(model)

    monkeypatch.setattr(binding_of(model).executor, "scope", scope)
    with pytest.raises(keras_parallel.ShardingError, match="refused plan"):
        model.fit(x, y, batch_size=16, verbose=0)
    assert left == ["scope entered"]
    assert binding_of(model).run is None
    assert len(run_module.callback_lists._handlers) == handlers_before
    assert keras.distribution.distribution() is None


class _Recorder:
    def __init__(self, name, events):
        self.name, self.events = name, events

    def __enter__(self):
        self.events.append(("enter", self.name, None))

    def __exit__(self, error_type, error, traceback):
        self.events.append(("exit", self.name, error_type))
        return False
