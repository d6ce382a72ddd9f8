"""`DistributedModel`: `compile(..., distribution=...)` for any Keras model."""

import contextlib
import os

import keras

from keras_parallel.backends import executor_class
from keras_parallel.keras_seam import first_batch
from keras_parallel.keras_seam.keras_compat import print_msg
from keras_parallel.keras_seam.model_state import binding_of, state_of
from keras_parallel.run.binding import Binding
from keras_parallel.run.run import Run

_ENTRY_POINTS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)


class DistributedModel:
    """A mixin that gives `compile` a `distribution` argument.

    Put it before `keras.Model` in the bases. `fit`, `evaluate`, `predict`
    and the `*_on_batch` methods then run on every device of the
    distribution with no other change to the training code. The model may be
    created, built, even trained before: its variables (and its optimizer's
    and metrics') are laid out anew. Nothing global is left behind when an
    entry point returns.

    Example:

    ```python
    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    inputs = keras.Input((784,))
    outputs = keras.layers.Dense(10)(inputs)
    model = Net(inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss="mse",
                  distribution=keras_parallel.DataParallel())
    model.fit(x, y, batch_size=64)  # the global batch, split over devices
    ```
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _check_base_order(cls)

    def compile(self, *args, distribution=None, **kwargs):
        """Configures the model for training, on one device or many.

        Args:
            *args: `keras.Model.compile` arguments.
            distribution: a `keras.distribution.Distribution`
                (`keras_parallel.DataParallel()`, `ModelParallel` with a
                `LayoutMap`), or `None` for one device.
            **kwargs: `keras.Model.compile` arguments.

        Raises:
            ValueError: the distribution is not a distribution, or does not
                fit this model (the message says what to change). The model
                is left on one device, its weights unchanged.
        """
        binding = None if distribution is None else Binding(distribution)
        unbind(self)
        super().compile(*args, **kwargs)
        if binding is not None:
            # A built model is planned now: a bad layout fails at compile,
            # and `load_weights` reads into the plan's layouts. An unbuilt
            # one is planned by its first run.
            binding.apply(self)
            state_of(self).binding = binding

    def __reduce__(self):
        # Keras pickles a model as its saved file and a function that loads
        # it, which looks the class up by its name among the registered
        # ones: unregistered, `Net` would not be found. pickle carries the
        # class itself (by its module and name, as any class it pickles).
        load, args = super().__reduce__()
        return _unpickled, (self.__class__, load.__name__, args)

    def save(self, *args, **kwargs):
        """`keras.Model.save`, in a file that plain Keras can load too.

        A functional or Sequential model is written as Keras's own
        `Functional` (`Sequential`) under this class's registered name:
        `keras.saving.load_model` gives this class where it is known
        (`custom_objects={"Net": Net}` or registered), compiled, with its
        optimizer state and its distribution; elsewhere a plain Keras model
        with its weights, compile config and optimizer state. See
        `keras_parallel.persistence.saving`.

        Args:
            *args: `keras.Model.save` arguments (`filepath`, ...).
            **kwargs: `keras.Model.save` arguments.

        Returns:
            What `keras.Model.save` returns.
        """
        from keras_parallel.persistence import atomic, saving

        with saving.saved_as_keras_class(DistributedModel):
            # A reader never sees half a file (`keras_parallel.persistence.atomic`).
            return atomic.call_replacing(
                super().save, args, kwargs, _executor(self), self
            )

    def save_weights(self, *args, **kwargs):
        """`keras.Model.save_weights`, written whole or not at all.

        Args:
            *args: `keras.Model.save_weights` arguments (`filepath`, ...).
            **kwargs: `keras.Model.save_weights` arguments.

        Returns:
            What `keras.Model.save_weights` returns.
        """
        from keras_parallel.persistence import atomic

        return atomic.call_replacing(
            super().save_weights, args, kwargs, _executor(self), self
        )

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`; an `OrbaxCheckpoint` folder shard by shard.

        On JAX, a folder written by `keras.callbacks.OrbaxCheckpoint` is read
        with `keras_parallel.restore_checkpoint` (its newest step): each array
        straight into the layout this model's plan gives it, on this mesh or
        another. Keras's own would read it onto the mesh it was saved from.
        Anything else is Keras's own.

        Args:
            filepath: a `.weights.h5` / `.keras` file, or an `OrbaxCheckpoint`
                folder (or one step's folder in it).
            *args: `keras.Model.load_weights` arguments.
            **kwargs: `keras.Model.load_weights` arguments.
        """
        if (
            os.path.isdir(os.fspath(filepath))
            and executor_class().checkpoint_io_class.restores_checkpoints
        ):
            from keras_parallel.persistence.checkpoints import restore_checkpoint

            restore_checkpoint(self, filepath)
            return None
        # Keras assigns variable by variable and stops at the first that does
        # not fit: put back what it had assigned, so a failed load leaves the
        # model as it was.
        before = _snapshot(self)
        try:
            return super().load_weights(filepath, *args, **kwargs)
        except Exception as error:
            for variable, value in before:
                variable.assign(value)
            kind = OSError if isinstance(error, OSError) else ValueError
            raise kind(
                f"The weights in {os.fspath(filepath)!r} cannot be loaded into "
                f"model {self.name!r}. Received: a file of another model, or a "
                "damaged one; the model is unchanged. Load it into the model "
                f"that saved it. The load failed with: {error}"
            ) from error

    def compile_from_config(self, config):
        """Compiles a loaded model from its saved compile config.

        Keras's own `compile_from_config` skips every class that overrides
        `compile`, ours included, and the optimizer state is then lost. A
        subclass with a `compile` of its own still gets Keras's behaviour:
        its arguments are not Keras's.

        Args:
            config: the compile config `get_compile_config` saved.
        """
        if type(self).compile is not DistributedModel.compile:
            return super().compile_from_config(config)
        from keras_parallel.persistence import saving

        saving.compile_from_config(self, config)

    def save_assets(self, dir_path):
        """Writes the distribution's description with the saved model.

        Args:
            dir_path: the model's assets folder (Keras's saving calls this).
        """
        parent = getattr(super(), "save_assets", None)
        if parent is not None:
            parent(dir_path)
        from keras_parallel.persistence import saving

        binding = binding_of(self)
        # An `Auto` that has not chosen yet saves nothing; once it has, the
        # loaded model gets the distribution it chose.
        unchosen = binding is not None and binding.unchosen()
        saving.save_distribution(None if unchosen else self.distribution, dir_path)

    def load_assets(self, dir_path):
        """Re-applies the saved distribution to the loaded, compiled model.

        Args:
            dir_path: the model's assets folder (Keras's loading calls this).
        """
        parent = getattr(super(), "load_assets", None)
        if parent is not None:
            parent(dir_path)
        from keras_parallel.persistence import saving

        binding = saving.saved_binding(self, dir_path, Binding)
        if binding is not None:
            unbind(self)
            state_of(self).binding = binding

    def get_weights(self):
        """`keras.Model.get_weights`, whole on every process.

        Across JAX processes a variable split over devices of several
        processes is gathered; elsewhere this is Keras's own.

        Returns:
            A list of NumPy arrays.
        """
        executor = _executor(self)
        if executor is None:
            return super().get_weights()
        return [executor.checkpoint_io.host_value(v.value) for v in self.weights]

    @property
    def distribution(self):
        """The distribution in effect, or `None` for one device (an `Auto`
        until it has chosen, then what it chose)."""
        binding = binding_of(self)
        if binding is None:
            return None
        return binding.auto if binding.unchosen() else binding.distribution

    def make_train_function(self, force=False):
        return _make(self, "train", super().make_train_function, force)

    def make_test_function(self, force=False):
        return _make(self, "test", super().make_test_function, force)

    def make_predict_function(self, force=False):
        return _make(self, "predict", super().make_predict_function, force)


def unbind(model):
    """Returns `model` to one device and forgets its distribution (a
    `compile` without one, or a loaded model given its saved one)."""
    binding = binding_of(model)
    if binding is not None:
        binding.release(model)
        state = state_of(model)
        state.binding = None
        state.made = {}


def _executor(model):
    binding = binding_of(model)
    return None if binding is None else binding.executor


def _make(model, kind, make, force):
    # The run planned the model before Keras makes its step (`run.Run`):
    # a step made under an older plan is made again.
    binding = binding_of(model)
    if binding is not None:
        state = state_of(model)
        if kind == "train" and state.announce:
            state.announce = False
            binding.announce(model, print_msg)
        if state.made.get(kind) != binding.version:
            force = True
            state.made[kind] = binding.version
    result = make(force=force)
    if binding is not None:
        binding.wrap_steps(model)
        if kind == "predict":
            # Keras's JAX trainer returns the function it made.
            result = model.predict_function
    return result


def _jax_setattr(self, name, value):
    # Keras's JAX `fit` stores its step state in `_jax_state` after every
    # step, and Layer.__setattr__ walks every value it is given for
    # variables to track: for the guide's convnet on 8 CPU devices, 3 of the
    # 4 host-side function calls of `fit` and several ms of host time per
    # step in a profile. Those are plain arrays: nothing to track.
    if name == "_jax_state":
        object.__setattr__(self, name, value)
        return
    super(DistributedModel, self).__setattr__(name, value)


def _unpickled(cls, load, args):
    """A pickled `DistributedModel`: Keras's `load(*args)` of class `cls`."""

    with keras.saving.custom_object_scope({cls.__name__: cls}):
        return getattr(cls, load)(*args)


def _snapshot(model):
    """`(variable, value)` of every model and optimizer variable, kept aside."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    keep = executor_class().checkpoint_io_class.kept_value
    return [(v, keep(v.value)) for v in variables]


def _check_base_order(cls):
    """Refuses `class Net(keras.Model, DistributedModel)`.

    With `keras.Model` first, Keras's own `compile` runs instead of ours and
    fails later with a bare "unexpected keyword argument 'distribution'".
    """

    mro = cls.__mro__
    if keras.Model in mro and mro.index(keras.Model) < mro.index(DistributedModel):
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        raise TypeError(
            f"DistributedModel must come before keras.Model in the bases of "
            f"{cls.__name__!r}, or keras.Model's own compile() runs and refuses "
            f"`distribution=`. Received: class {cls.__name__}({bases}); write "
            f"class {cls.__name__}(keras_parallel.DistributedModel, keras.Model) "
            "instead."
        )


def _entry_point(name):
    def method(self, *args, **kwargs):
        binding = binding_of(self)
        call = getattr(super(DistributedModel, self), name)
        if binding is None or binding.run is not None:
            # One device, or an entry point inside a run (the evaluation
            # inside `fit`): the run in force holds.
            return call(*args, **kwargs)
        if name == "fit":
            # fit(x, y, batch_size, epochs, verbose, ...): the plan is printed
            # once the step is made, when every variable exists.
            verbose = kwargs.get("verbose", args[4] if len(args) > 4 else "auto")
            state_of(self).announce = verbose != 0
        build = _built_from_batch(self, name, args, kwargs)
        if binding.unchosen():
            return _run_after_choice(self, binding, name, build, args, kwargs)
        with Run(binding, self, build=build):
            return call(*args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"DistributedModel.{name}"
    method.__doc__ = (
        f"`keras.Model.{name}`, run under the model's distribution "
        "(see `DistributedModel.compile`)."
    )
    return method


def _run_after_choice(model, binding, name, build, args, kwargs):
    """`Auto`'s step, then the run, for an entry point of `model`.

    Where the backend predicts from the model alone, the choice is made
    first. Else it needs the global batch: a `*_on_batch` call gives it,
    and `fit` and `evaluate` draw it as Keras builds the model
    (`first_batch`): the run begins there, before Keras makes its callback
    list or any step. A prediction before any batch is refused.
    """
    call = getattr(super(DistributedModel, model), name)
    if not executor_class().auto_support.needs_batch:
        binding.choose(model)
        with Run(binding, model, build=build):
            return call(*args, **kwargs)
    if name.startswith("predict"):
        raise binding.prediction_refused(model, name)
    if build is not None:
        batch = build.batch
        model._symbolic_build(data_batch=batch)  # Keras's own build, first.
        binding.choose(model, batch)
        with Run(binding, model, build=build):
            return call(*args, **kwargs)
    with contextlib.ExitStack() as stack:

        def chosen(batch):
            binding.choose(model, batch)
            stack.enter_context(Run(binding, model))

        stack.callback(first_batch.watch(model, chosen))
        return call(*args, **kwargs)


def _built_from_batch(model, name, args, kwargs):
    """For a `*_on_batch` call, a function that builds what is unbuilt of
    `model` from its batch, as Keras's own call does first; else None.
    The batch is its `batch`.

    No callback list marks the moment Keras has built the model in these
    calls: built here first, the run plans it before Keras makes its step.
    """
    if not name.endswith("_on_batch"):
        return None
    names = ("x", "y", "sample_weight")
    values = dict(zip(names, args, strict=False))
    batch = tuple(kwargs.get(n, values.get(n)) for n in names)
    kind = name.partition("_")[0]

    def build():
        binding_of(model).executor.build_from_batch(model, kind, batch)

    build.batch = batch
    return build


for _name in _ENTRY_POINTS:
    setattr(DistributedModel, _name, _entry_point(_name))
if keras.backend.backend() == "jax":
    # JAX alone: elsewhere every attribute set on a model (Keras sets two
    # as each layer is called) would pass through one more function.
    DistributedModel.__setattr__ = _jax_setattr
