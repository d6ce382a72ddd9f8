"""`ShardingCallback`: a distribution for a model you cannot subclass."""

import keras

from keras_parallel.backends import executor_class
from keras_parallel.keras_seam import callback_lists
from keras_parallel.keras_seam.keras_compat import print_msg
from keras_parallel.keras_seam.model_state import state_of
from keras_parallel.persistence import atomic
from keras_parallel.run.binding import Binding
from keras_parallel.run.run import Run

_STEP_FUNCTIONS = ("train_function", "test_function", "predict_function")


class ShardingCallback(callback_lists.PhaseCallback):
    """Runs `fit`, `evaluate` or `predict` of any compiled model distributed.

    The same machinery as `DistributedModel`, entered through the callback
    hooks: at `set_model` (the model, optimizer and metrics are built, the
    step function not made yet) the plan is resolved, validated and applied;
    when the run ends, global state is put back as it was, and so are the
    model's step functions: the same model then runs plainly on one device
    (`model.predict(x)` with no callback), while its variables keep their
    distributed placement. The next run through this callback reuses the
    steps it compiled.

    If `fit` raises, Keras calls no callback at the end; the distribution
    then stays in force until this callback's next run or `close()`. Prefer
    `DistributedModel` where you can subclass.

    Args:
        distribution: a `keras.distribution.Distribution`
            (`keras_parallel.DataParallel()`, `ModelParallel`), or
            `keras_parallel.Auto` (`"auto"`): chosen from the first train
            (or test) step's batch, before that step runs (Keras drew the
            batch it builds the model from before it handed this callback
            the model).

    Raises:
        ValueError: `distribution` is not a distribution, or this backend
            cannot run it.

    Example:

    ```python
    model = keras.saving.load_model("pretrained.keras")
    model.fit(x, y, batch_size=64,
              callbacks=[keras_parallel.ShardingCallback(
                  keras_parallel.DataParallel())])
    ```
    """

    async_safe = True

    def __init__(self, distribution):
        # Each run's six begin and end hooks: `PhaseCallback`'s.
        super().__init__(on_begin=self._begin, on_end=self._end)
        self.binding = Binding(distribution)
        self._phase = None
        #: The model's own step functions, put back when the run ends.
        self._plain_steps = None
        #: The steps compiled for the plan, kept for the next run.
        self._distributed_steps = {}
        self._steps_version = None
        self._remove_handler = None
        #: A `PhaseCallback` last in this run's list ends the run there.
        self._ends_last = False

    @property
    def distribution(self):
        """The distribution in effect (an `Auto` until it has chosen)."""
        binding = self.binding
        return binding.auto if binding.unchosen() else binding.distribution

    def set_model(self, model):
        if self.binding.run is not None or self._plain_steps is not None:
            # A run that raised left its scope entered, or its steps in
            # place: leave it first.
            self.close()
        _check_model(model)
        super().set_model(model)
        # So that `describe(model)` finds the plan this callback applied;
        # set past Keras's and torch's attribute tracking.
        state_of(model).callback_binding = self.binding
        self._plain_steps = {
            name: getattr(model, name, None) for name in _STEP_FUNCTIONS
        }
        if self.binding.unchosen():
            if not executor_class().auto_support.needs_batch:
                self.binding.choose(model)
            else:
                # Chosen at the first train (or test) step, from its batch
                # (`_chosen_at_first_step`): the run begins there.
                self._end_runs_after_every_callback()
                return
        self._begin_run(model)
        # Keras makes its step functions next; those of this plan are
        # reused, others are made for it.
        reuse = self._steps_version == self.binding.version
        for name in _STEP_FUNCTIONS:
            setattr(model, name, self._distributed_steps.get(name) if reuse else None)
        self._end_runs_after_every_callback()

    def _begin_run(self, model):
        # The model is built: the run plans it as it begins. Its
        # `ModelCheckpoint`'s files appear whole, as a DistributedModel's do.
        executor = self.binding.executor
        run = Run(
            self.binding,
            model,
            overrides=[lambda: atomic.atomic_saving(model, executor)],
        )
        run.__enter__()

    def _end_runs_after_every_callback(self):
        # Keras calls this callback's `on_*_end` before those of the callbacks
        # after it, the progress bar's among them: the run ends once the
        # whole callback list has ended it, in a callback placed last in the
        # list Keras is making (`keras_seam/callback_lists.py`).
        self._ends_last = False
        if self._remove_handler is not None:
            self._remove_handler()

        def append_run_end(callback_list):
            if any(c is self for c in callback_list.callbacks):
                self._remove_handler()
                self._remove_handler = None
                callback_lists.append_callback(
                    callback_list, callback_lists.PhaseCallback(on_end=self._run_ended)
                )
                self._ends_last = True

        self._remove_handler = callback_lists.add_handler(append_run_end)

    def close(self):
        """Ends the run: leaves the distribution's scope, puts back the
        model's own step functions. Safe to call more than once."""
        self._phase = None
        self._ends_last = False
        if self._remove_handler is not None:
            self._remove_handler()
            self._remove_handler = None
        if self.binding.run is not None:
            self.binding.run.close()
        if self._plain_steps is not None:
            model, plain, self._plain_steps = self.model, self._plain_steps, None
            executor = self.binding.executor
            if executor is not None and executor.released_after_a_callback_run:
                # Planned and compiled anew by the next run.
                self.binding.release(model)
            for name in _STEP_FUNCTIONS:
                function = getattr(model, name, None)
                if function is not None and function is not plain[name]:
                    self._distributed_steps[name] = function
                setattr(model, name, plain[name])
            self._steps_version = self.binding.version

    def _begin(self, phase):
        if self._phase is None:
            self._phase = phase
        if self.binding.unchosen():
            if phase == "predict":
                # No batch to train by: Keras calls no callback after this
                # raises, so the run ends here.
                self.close()
                raise self.binding.prediction_refused(self.model, "predict")
            name = f"{phase}_function"
            function = getattr(self.model, name)
            setattr(self.model, name, self._chosen_at_first_step(phase, function))
            return
        # Keras has made its step function by now (make_*_function runs
        # just before on_*_begin).
        self.binding.wrap_steps(self.model)

    def _chosen_at_first_step(self, kind, function):
        """`function`, choosing `Auto`'s distribution from its first batch.

        Keras drew the batch it builds the model from before it handed this
        callback the model: `Auto` chooses from the first step's batch, the
        run begins, and the step is made again for the plan and run. No step
        has run before the choice.
        """
        model, cls = self.model, executor_class()

        def step(*args, **kwargs):
            if not self.binding.unchosen():
                return function(*args, **kwargs)
            batch, args = cls.first_step_batch(kind, args)

            def choose_and_begin():
                self.binding.choose(model, batch)
                self._begin_run(model)
                setattr(model, f"{kind}_function", None)
                getattr(model, f"make_{kind}_function")(force=True)
                self.binding.wrap_steps(model)

            args = cls.replanned_step_args(model, kind, args, choose_and_begin)
            return getattr(model, f"{kind}_function")(*args, **kwargs)

        return step

    def _run_ended(self, phase):
        if self._phase == phase:
            self.close()

    def _end(self, phase):
        # In a list that ends with its `PhaseCallback`, the run ends there; called on
        # its own, now.
        if self._phase == phase and not self._ends_last:
            self.close()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if self.params.get("verbose", 1) != 0:
            self.binding.announce(self.model, print_msg)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "ShardingCallback distributes a keras.Model's fit, evaluate and "
            f"predict. Received: a {type(model).__name__}, which is not a "
            "keras.Model; build the model as a keras.Model (functional, "
            "Sequential or a subclass of keras.Model) to distribute it."
        )
