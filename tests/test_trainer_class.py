"""The model's class while an entry point runs (`keras_parallel.trainer_class`)."""

import pickle

import keras
import numpy as np
import pytest

from keras_parallel.trainer_class import (
    TrainerMixin,
    attribute_of,
    swap_class,
    trainer_class,
)


class Recording(TrainerMixin):
    """A trainer mixin that records its calls and hands them on."""

    calls = []

    def test_step(self, *args):
        Recording.calls.append("mixin")
        return super().test_step(*args)


@keras.saving.register_keras_serializable(package="kp_tests")
class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def test_step(self, *args):  # (data), or (state, data) on JAX.
        Recording.calls.append("own")
        return super().test_step(*args)


def _net():
    model = Net()
    model.compile(loss="mse")
    model(np.zeros((1, 3), "float32"))
    model.optimizer.build(model.trainable_variables)
    return model


def _calls_of_evaluate_under(model, mixin):
    """What `Recording.calls` holds after an `evaluate` with `mixin` swapped in."""
    restore = swap_class(model, mixin)
    Recording.calls.clear()
    try:
        model.evaluate(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    finally:
        restore()
    return Recording.calls[:2]


def test_the_mixin_comes_before_the_models_own_methods():
    model = _net()
    assert _calls_of_evaluate_under(model, Recording) == ["mixin", "own"]
    assert type(model).test_step is Net.test_step


def test_the_model_shows_its_own_class_and_is_put_back():
    model = _net()
    restore = swap_class(model, Recording)
    assert type(model).__mro__[1] is Recording
    assert model.__class__ is Net
    assert isinstance(model, Net) and isinstance(model, Recording)
    restore()
    assert type(model) is Net and model.__class__ is Net


def test_one_subclass_per_class_and_mixins():
    assert trainer_class(Net, (Recording,)) is trainer_class(Net, (Recording,))
    made = trainer_class(Net, (Recording,))
    assert (made.__name__, made.__qualname__, made.__module__) == (
        Net.__name__,
        Net.__qualname__,
        Net.__module__,
    )


def test_a_class_swapped_twice_still_shows_the_models_own():
    class Other(TrainerMixin):
        pass

    model = _net()
    outer = swap_class(model, Recording)
    inner = swap_class(model, Other)
    assert type(model).__mro__[1:3] == (Other, Recording)
    assert model.__class__ is Net
    inner()
    assert type(model).__mro__[1] is Recording
    outer()
    assert type(model) is Net


def test_swaps_ended_in_any_order_leave_the_mixins_still_in_force():
    class Other(TrainerMixin):
        pass

    model = _net()
    first = swap_class(model, Recording, _kp_first=1)
    second = swap_class(model, Other, _kp_second=2)
    first()
    assert type(model).__mro__[1] is Other and model.__class__ is Net
    assert not hasattr(model, "_kp_first") and model._kp_second == 2
    first()  # Twice: nothing more.
    assert type(model).__mro__[1] is Other
    second()
    assert type(model) is Net and "_kp_swaps" not in vars(model)


def test_what_is_saved_during_the_swap_is_what_is_saved_without(tmp_path):
    model = _net()
    plain = keras.saving.serialize_keras_object(model)
    restore = swap_class(model, Recording)
    try:
        swapped = keras.saving.serialize_keras_object(model)
        model.save(tmp_path / "during.keras")
    finally:
        restore()
    assert swapped == plain
    assert plain["registered_name"] == "kp_tests>Net"
    loaded = keras.saving.load_model(tmp_path / "during.keras")
    assert type(loaded) is Net


def test_a_method_the_model_holds_itself_is_set_aside_and_put_back():
    model = _net()

    def own_step(data):
        return {}

    object.__setattr__(model, "test_step", own_step)
    restore = swap_class(model, Recording)
    assert "test_step" not in vars(model)
    assert model.test_step.__func__ is Recording.test_step
    restore()
    assert vars(model)["test_step"] is own_step


def test_the_names_set_aside_are_the_mixins_own():
    class Saving(TrainerMixin):
        def save(self, *args, **kwargs):
            return super().save(*args, **kwargs)

    class MoreSaving(Saving):
        def save_weights(self, *args, **kwargs):
            return super().save_weights(*args, **kwargs)

    from keras_parallel.trainer_class import names_of

    assert names_of(Recording) == ("calls", "test_step")
    assert names_of(MoreSaving) == ("save_weights", "save")


def test_a_swap_ended_while_another_of_its_names_is_in_force_leaves_that_one_seen():
    class Other(TrainerMixin):
        def test_step(self, *args):
            Recording.calls.append("other")
            return super().test_step(*args)

    model = _net()

    def own_step(*args):
        return {}

    object.__setattr__(model, "test_step", own_step)
    first = swap_class(model, Recording)
    second = swap_class(model, Other)
    first()  # Other still defines test_step: the model's own stays aside.
    assert "test_step" not in vars(model)
    assert model.test_step.__func__ is Other.test_step
    second()
    assert vars(model)["test_step"] is own_step and type(model) is Net
    assert "_kp_set_aside" not in vars(model)


def test_made_classes_are_released_with_their_models():
    import gc
    import weakref

    model = _net()
    restore = swap_class(model, Recording)
    made = weakref.ref(type(model))
    restore()
    assert trainer_class(Net, (Recording,)) is made()  # Reused while alive.
    gc.collect()
    assert made() is None

    # A class's made subclasses hold it: they must not keep it alive.
    class Plain:
        pass

    trainer_class(Plain, (Recording,))
    plain = weakref.ref(Plain)
    del Plain
    gc.collect()
    assert plain() is None


def test_a_method_can_be_an_attribute_of_an_object_the_model_holds():
    class Held(TrainerMixin):
        test_step = attribute_of("_kp_holder", "test_step")

    model = _net()

    class Holder:
        def test_step(self, *args):
            Recording.calls.append("holder")
            return Net.test_step(model, *args)

    object.__setattr__(model, "_kp_holder", Holder())
    assert _calls_of_evaluate_under(model, Held) == ["holder", "own"]
    assert model.test_step.__func__ is Net.test_step


def test_a_mixin_in_force_twice_is_one_base_until_both_end():
    model = _net()
    first = swap_class(model, Recording, _kp_state="first")
    second = swap_class(model, Recording, _kp_state="second")
    assert (
        type(model).__mro__[1] is Recording and Recording not in type(model).__mro__[2:]
    )
    assert model._kp_state == "second"
    second()
    assert type(model).__mro__[1] is Recording and model._kp_state == "first"
    first()
    assert type(model) is Net


def test_swapping_anything_but_a_model_is_refused():
    with pytest.raises(LookupError, match="__class__"):
        swap_class(keras.layers.Dense(2), Recording)


def test_a_distributed_model_shows_its_own_class_and_is_plain_once_released():
    import keras_parallel

    class Distributed(keras_parallel.DistributedModel, keras.Model):
        pass

    devices = None
    if keras.backend.backend() == "tensorflow":
        import tf_devices

        devices = tf_devices.devices(2)
    inputs = keras.Input((3,))
    model = Distributed(inputs, keras.layers.Dense(2)(inputs))
    model.compile(
        optimizer="sgd",
        loss="mse",
        distribution=keras_parallel.DataParallel(devices=devices),
    )
    seen = []

    class SeeClass(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.__class__)

    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[SeeClass()])
    assert seen and set(seen) == {Distributed}
    assert model.__class__ is Distributed
    model.compile(optimizer="sgd", loss="mse")  # One device: released.
    assert type(model) is Distributed and "_kp_swaps" not in vars(model)


def test_a_model_pickled_during_the_swap_unpickles_as_its_own_class():
    # Keras pickles `type(model)._unpickle_model`: pickle finds a class by
    # module and name, where the made subclass's name is the model's.
    model = _net()
    x = np.ones((2, 3), "float32")
    restore = swap_class(model, Recording)
    try:
        assert type(model) is not Net
        pickled = pickle.dumps(model)
    finally:
        restore()
    loaded = pickle.loads(pickled)
    assert type(loaded) is Net
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )


def test_a_plain_model_pickled_in_a_sharding_callback_run_unpickles_whole():
    import keras_parallel

    devices = None
    if keras.backend.backend() == "tensorflow":
        import tf_devices

        devices = tf_devices.devices(2)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    pickled = []

    class Pickle(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pickled.append(pickle.dumps(self.model))

    x = np.arange(24, dtype="float32").reshape(8, 3) / 24
    sharding = keras_parallel.ShardingCallback(
        keras_parallel.DataParallel(devices=devices)
    )
    model.fit(x, x[:, :2], batch_size=4, verbose=0, callbacks=[sharding, Pickle()])
    loaded = pickle.loads(pickled[-1])  # After the last step: fit's weights.
    assert type(loaded) is type(model)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )


def test_a_held_swap_is_put_in_force_once_and_ended_once():
    from keras_parallel.trainer_class import HeldSwap

    model = _net()
    held = HeldSwap()
    held.hold(lambda: swap_class(model, Recording))
    held.hold(lambda: swap_class(model, Recording))  # Held: not swapped again.
    assert len(vars(model)["_kp_swaps"]) == 1
    held.end()
    assert type(model) is Net
    held.end()  # Twice: nothing more.
    assert type(model) is Net
