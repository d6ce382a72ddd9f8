"""A model's methods while a part is in force (`keras_parallel.keras_seam.overrides`)."""

import pickle

import keras
import numpy as np
import pytest

from keras_parallel.keras_seam import keras_compat
from keras_parallel.keras_seam.model_state import state_of
from keras_parallel.keras_seam.overrides import (
    HeldOverride,
    Overrides,
    in_force,
    override,
)

#: What the overrides and the model's own `test_step` were called, in order.
CALLS = []


@pytest.fixture(autouse=True)
def test_step_listed(monkeypatch):
    """Lists a model's `test_step` as replaced (on every backend: torch's
    table lists it for its trainer), as every name an override puts on a
    model must be."""
    from keras_parallel.keras_seam.replacement_targets import Target

    listed = Target(
        "keras.src.models.model.Model", "test_step", "tests", on_instances=True
    )
    monkeypatch.setattr(keras_compat, "REPLACED", (*keras_compat.REPLACED, listed))


class Recording(Overrides):
    """Records its calls and hands them on to the method it hides."""

    names = ("test_step",)

    def __init__(self, label="override"):
        self.label = label

    def test_step(self, *args):
        CALLS.append(self.label)
        return self.overridden.test_step(*args)


class Other(Overrides):
    """Another class of override of the same method."""

    names = ("test_step",)

    def test_step(self, *args):
        CALLS.append("other")
        return self.overridden.test_step(*args)


@keras.saving.register_keras_serializable(package="kp_tests")
class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def test_step(self, *args):  # (data), or (state, data) on JAX.
        CALLS.append("own")
        return super().test_step(*args)


def _net():
    model = Net()
    model.compile(loss="mse")
    model(np.zeros((1, 3), "float32"))
    model.optimizer.build(model.trainable_variables)
    return model


def _calls_of_evaluate(model):
    """The first calls `evaluate` makes of the overrides and the model's own."""
    CALLS.clear()
    # Made anew: a compiled step (JAX, TensorFlow) calls no Python again.
    model.test_function = None
    model.evaluate(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    return list(dict.fromkeys(CALLS))


def test_an_override_comes_before_the_models_own_method():
    model = _net()
    end = override(model, Recording())
    try:
        assert _calls_of_evaluate(model) == ["override", "own"]
    finally:
        end()
    assert _calls_of_evaluate(model) == ["own"]


def test_the_models_class_is_never_changed():
    model = _net()
    end = override(model, Recording())
    assert type(model) is Net and model.__class__ is Net
    assert vars(model)["test_step"].__func__ is Recording.test_step
    end()
    assert type(model) is Net and "test_step" not in vars(model)
    assert state_of(model).overrides == [] and state_of(model).installed == ()


def test_the_newest_override_comes_first():
    model = _net()
    outer = override(model, Recording())
    inner = override(model, Other())
    assert [type(o) for o in in_force(model)] == [Other, Recording]
    assert _calls_of_evaluate(model) == ["other", "override", "own"]
    inner()
    assert _calls_of_evaluate(model) == ["override", "own"]
    outer()
    assert in_force(model) == ()


def test_overrides_ended_in_any_order_leave_the_others_in_force():
    model = _net()
    first = override(model, Recording())
    second = override(model, Other())
    first()
    assert [type(o) for o in in_force(model)] == [Other]
    assert _calls_of_evaluate(model) == ["other", "own"]
    first()  # Twice: nothing more.
    assert [type(o) for o in in_force(model)] == [Other]
    second()
    assert in_force(model) == () and "test_step" not in vars(model)


def test_what_is_saved_during_an_override_is_what_is_saved_without(tmp_path):
    model = _net()
    plain = keras.saving.serialize_keras_object(model)
    end = override(model, Recording())
    try:
        during = keras.saving.serialize_keras_object(model)
        model.save(tmp_path / "during.keras")
    finally:
        end()
    assert during == plain
    assert plain["registered_name"] == "kp_tests>Net"
    loaded = keras.saving.load_model(tmp_path / "during.keras")
    assert type(loaded) is Net


def test_a_method_the_model_holds_itself_is_set_aside_and_put_back():
    model = _net()

    def own_step(data):
        return {}

    object.__setattr__(model, "test_step", own_step)
    end = override(model, Recording())
    assert model.test_step.__func__ is Recording.test_step
    # The override hides the class's method, not the one set aside.
    assert model.test_step.__self__.overridden.test_step.__func__ is Net.test_step
    end()
    assert vars(model)["test_step"] is own_step


def test_an_override_ended_while_another_of_its_names_is_in_force_leaves_that_one():
    model = _net()

    def own_step(*args):
        return {}

    object.__setattr__(model, "test_step", own_step)
    first = override(model, Recording())
    second = override(model, Other())
    first()  # Other still replaces test_step: the model's own stays aside.
    assert model.test_step.__func__ is Other.test_step
    second()
    assert vars(model)["test_step"] is own_step
    assert state_of(model).set_aside == {}


def test_a_method_can_be_another_objects_with_no_frame_between():
    model = _net()

    class Holder:
        def test_step(self, *args):
            CALLS.append("holder")
            return Net.test_step(model, *args)

    holder = Holder()

    class Held(Overrides):
        names = ("test_step",)

        def __init__(self):
            self.test_step = holder.test_step

    end = override(model, Held())
    try:
        # Keras calls the holder's own bound method.
        assert model.test_step == holder.test_step
        assert _calls_of_evaluate(model) == ["holder", "own"]
    finally:
        end()


def test_one_class_in_force_twice_counts_once_the_newest_object():
    model = _net()
    first = override(model, Recording("first"))
    second = override(model, Recording("second"))
    assert [o.label for o in in_force(model)] == ["second"]
    assert _calls_of_evaluate(model) == ["second", "own"]
    second()
    assert _calls_of_evaluate(model) == ["first", "own"]
    first()
    assert in_force(model) == ()


def test_overriding_anything_but_a_model_is_refused():
    with pytest.raises(LookupError, match="test_step"):
        override(keras.layers.Dense(2), Recording())


def test_overriding_a_method_no_table_lists_is_refused():
    class Unlisted(Overrides):
        names = ("summary",)

        def summary(self):
            return None

    model = _net()
    with pytest.raises(LookupError, match="summary"):
        override(model, Unlisted())
    assert in_force(model) == () and "summary" not in vars(model)


def _devices():
    if keras.backend.backend() == "tensorflow":
        import tf_devices

        return tf_devices.devices(2)
    return None


class _SeeClass(keras.callbacks.Callback):
    """Records `(type(model), model.__class__)` after every training batch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((type(self.model), self.model.__class__))


def test_a_distributed_models_class_is_its_own_through_both_doors():
    import keras_parallel

    class Distributed(keras_parallel.DistributedModel, keras.Model):
        pass

    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    inputs = keras.Input((3,))
    model = Distributed(inputs, keras.layers.Dense(2)(inputs))
    distribution = keras_parallel.DataParallel(devices=_devices())
    model.compile(optimizer="sgd", loss="mse", distribution=distribution)
    see = _SeeClass()
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[see])
    assert see.seen and set(see.seen) == {(Distributed, Distributed)}
    model.compile(optimizer="sgd", loss="mse")  # One device: released.
    assert type(model) is Distributed and in_force(model) == ()

    plain = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    plain.compile(optimizer="sgd", loss="mse")
    see = _SeeClass()
    sharding = keras_parallel.ShardingCallback(
        keras_parallel.DataParallel(devices=_devices())
    )
    plain.fit(x, y, batch_size=4, verbose=0, callbacks=[sharding, see])
    assert see.seen and set(see.seen) == {(type(plain), type(plain))}


def test_a_model_pickled_during_an_override_unpickles_as_its_own_class():
    model = _net()
    x = np.ones((2, 3), "float32")
    end = override(model, Recording())
    try:
        pickled = pickle.dumps(model)
    finally:
        end()
    loaded = pickle.loads(pickled)
    assert type(loaded) is Net and in_force(loaded) == ()
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )


def test_a_plain_model_pickled_in_a_sharding_callback_run_unpickles_whole():
    import keras_parallel

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    pickled = []

    class Pickle(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pickled.append(pickle.dumps(self.model))

    x = np.arange(24, dtype="float32").reshape(8, 3) / 24
    sharding = keras_parallel.ShardingCallback(
        keras_parallel.DataParallel(devices=_devices())
    )
    model.fit(x, x[:, :2], batch_size=4, verbose=0, callbacks=[sharding, Pickle()])
    loaded = pickle.loads(pickled[-1])  # After the last step: fit's weights.
    assert type(loaded) is type(model)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )


def test_a_held_override_is_put_in_force_once_and_ended_once():
    model = _net()
    held = HeldOverride()
    held.hold(lambda: override(model, Recording()))
    held.hold(lambda: override(model, Recording()))  # Held: not again.
    assert len(state_of(model).overrides) == 1
    held.end()
    assert in_force(model) == ()
    held.end()  # Twice: nothing more.
    assert in_force(model) == ()
