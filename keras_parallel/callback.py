"""`ShardingCallback`: a distribution for a model you cannot subclass."""

import keras

from keras_parallel.binding import Binding
from keras_parallel.keras_compat import print_msg
from keras_parallel.persistence import atomic

_PHASES = ("train", "test", "predict")


class ShardingCallback(keras.callbacks.Callback):
    """Runs `fit`, `evaluate` or `predict` of any compiled model distributed.

    The same machinery as `DistributedModel`, entered through the callback
    hooks: at `set_model` (the model, optimizer and metrics are built, the
    step function not made yet) the plan is resolved, validated and applied;
    when the run ends, global state is put back as it was.

    If `fit` raises, Keras calls no callback at the end; the distribution
    then stays in force until this callback's next run or `close()`. Prefer
    `DistributedModel` where you can subclass.

    Args:
        distribution: a `keras.distribution.Distribution`
            (`keras_parallel.DataParallel()`, `ModelParallel`).

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
        super().__init__()
        self.binding = Binding(distribution)
        self._phase = None
        self._undo_saving = None

    @property
    def distribution(self):
        return self.binding.distribution

    def set_model(self, model):
        if self.binding.active:
            # A run that raised left its scope entered: leave it first.
            self.close()
        super().set_model(model)
        # So that `describe(model)` finds the plan this callback applied;
        # set past Keras's and torch's attribute tracking.
        object.__setattr__(model, "_kp_callback_binding", self.binding)
        if self.binding.prepare(model):
            # Keras makes its step functions next; make them for this plan.
            model.train_function = None
            model.test_function = None
            model.predict_function = None
        self.binding.enter(model)
        # `ModelCheckpoint`'s files appear whole, as a DistributedModel's do.
        self._undo_saving = atomic.atomic_saving(model, self.binding.executor)

    def close(self):
        """Leaves the distribution's scope; safe to call more than once."""
        self._phase = None
        while self.binding.active:
            self.binding.exit(self.model)
        if self._undo_saving is not None:
            self._undo_saving()
            self._undo_saving = None

    def _begin(self, phase):
        if self._phase is None:
            self._phase = phase
        # Keras has made its step function by now (make_*_function runs
        # just before on_*_begin).
        self.binding.wrap_steps(self.model)

    def _end(self, phase):
        if self._phase == phase:
            self.close()

    def on_train_begin(self, logs=None):
        self._begin("train")
        if self.params.get("verbose", 1) != 0:
            self.binding.announce(self.model, print_msg)

    def on_train_end(self, logs=None):
        self._end("train")

    def on_test_begin(self, logs=None):
        self._begin("test")

    def on_test_end(self, logs=None):
        self._end("test")

    def on_predict_begin(self, logs=None):
        self._begin("predict")

    def on_predict_end(self, logs=None):
        self._end("predict")
