"""`Run`: what keras_parallel puts in force around one entry point, and undoes.

One `Run` per entry point (`fit`, `evaluate`, `predict`, the `*_on_batch`
calls), made alike by both doors: `DistributedModel`'s entry points and
`ShardingCallback.set_model`. It is the one owner of everything in force
while Keras's trainer runs, in one exit stack:

    entered, in this order                  left, in the reverse order
    1. the run's callback-list handler      (plans the model Keras built)
    2. the executor's `scope(model)`        (backend state, failure report)
    3. exact backups (`BackupAndRestore`)
    4. the preemption watch (signals, stop agreement) and the stall watch,
       both on one heartbeat (one store request a second per process)
    5. the plan's `planned_scope(model)`, once a plan is applied (again
       when a newer plan is: the older one's left first)
    6. the door's own overrides (a callback's whole-file saving)

A run plans its model in one place (`_plan`), at two moments: as it begins
(after 4), if the model is built (for the `*_on_batch` calls, once Keras's
own build from the batch, called first here, has built it); else once
Keras has built it (`model_built`), which is when Keras makes the run's
callback list (`fit`, `evaluate`, `predict`), or, where Keras builds only
inside the first step (torch's `predict`, TensorFlow's `predict_on_batch`),
in that step (`Binding.wrap_steps`). A bad layout is refused before Keras's
loop, and every part entered is left knowing the error.

While an exception unwinds, every part is left knowing it (no collective
runs: another process may never reach it); a preemption is such an exception
(`Preempted`). An entry point called inside a run of the same model (the
evaluation inside `fit`) runs in the outer run: the doors make no second one.
"""

import contextlib

from keras_parallel.keras_seam import callback_lists
from keras_parallel.persistence.backup import ExactBackups
from keras_parallel.persistence.preemption import PreemptionWatch
from keras_parallel.run.heartbeat import Heartbeat
from keras_parallel.run.stall_watch_part import StallWatchPart


class Run:
    """Everything in force around one entry point of one model.

    Args:
        binding: the model's `Binding` (its distribution, executor and plan).
        model: the `keras.Model` whose entry point runs.
        build: for the `*_on_batch` calls, a function that builds what is
            unbuilt of the model (and its optimizer and metrics) from the
            batch, as Keras does first (`_built_from_batch` in `model.py`):
            called here, the model is planned before Keras makes its step.
        overrides: functions called once in force, each putting an override
            in force and returning the function that ends it (the callback
            door's whole-file saving).

    Example:

    ```python
    with Run(binding, model):
        keras.Model.fit(model, x, y)  # Keras's own loop, planned
    ```
    """

    def __init__(self, binding, model, build=None, overrides=()):
        self.binding = binding
        self.model = model
        self._build = build
        self._overrides = tuple(overrides)
        self._stack = None
        #: The applied plan's `planned_scope`, while one is in force.
        self._planned = None

    def __enter__(self):
        binding, model, executor = self.binding, self.model, self.binding.executor
        if binding.unchosen():
            raise RuntimeError(
                f"Auto has not chosen the distribution of model {model.name!r}. "
                "Received: a run entered before the choice; a door calls "
                "`Binding.choose` first."
            )
        if binding.run is not None:
            raise RuntimeError(
                f"A run of model {model.name!r} is already in force. Received: "
                "a second run entered inside it; an entry point inside a run "
                "runs in the outer run."
            )
        stack = contextlib.ExitStack()
        try:
            stack.callback(callback_lists.add_handler(self._list_made))
            stack.enter_context(executor.scope(model))
            backups = ExactBackups(executor)
            backups.install()
            stack.callback(backups.uninstall)
            heartbeat = Heartbeat()
            stack.callback(heartbeat.close)
            stack.enter_context(PreemptionWatch(executor, heartbeat))
            stack.enter_context(StallWatchPart(executor, heartbeat))
            binding.run = self
            stack.callback(self._detach)
            stack.push(self._leave_plan)
            if self._build is not None:
                self._build()
            self._plan()
            for start in self._overrides:
                stack.callback(start())
        except BaseException as error:
            stack.__exit__(type(error), error, error.__traceback__)
            raise
        self._stack = stack
        return self

    def __exit__(self, error_type, error, traceback):
        stack, self._stack = self._stack, None
        if stack is None:
            return False
        return stack.__exit__(error_type, error, traceback)

    def close(self):
        """Ends the run as on success (a callback's run ended by its hooks)."""
        self.__exit__(None, None, None)

    def model_built(self):
        """Plans the model Keras has built inside this run: when Keras makes
        the run's callback list (`fit`, `evaluate`, `predict`), or in the
        first step of torch's `predict` (`Binding.wrap_steps`).

        Returns:
            True if a new plan was applied.

        Raises:
            ShardingError: the distribution does not fit the model (nothing
                was moved).
        """
        return self._plan()

    def _plan(self):
        # The one planning of a run: the plan applied if the model's
        # variables changed, and its `planned_scope` in force for the rest of
        # the run (an older plan's scope left first).
        applied = self.binding.apply(self.model)
        if applied:
            self._leave_plan(None, None, None)
        if self.binding.plan is not None and self._planned is None:
            planned = contextlib.ExitStack()
            planned.enter_context(self.binding.executor.planned_scope(self.model))
            self._planned = planned
        return applied

    def _list_made(self, callback_list):
        # Keras makes a run's callback list once it has built the model,
        # optimizer and metrics, before it makes the step function.
        if callback_list.model is self.model:
            self.model_built()

    def _leave_plan(self, error_type, error, traceback):
        planned, self._planned = self._planned, None
        if planned is not None:
            planned.__exit__(error_type, error, traceback)
        return False

    def _detach(self):
        self.binding.run = None
