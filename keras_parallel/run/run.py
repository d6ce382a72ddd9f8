"""`Run`: what keras_parallel puts in force around one entry point, and undoes.

One `Run` per entry point (`fit`, `evaluate`, `predict`, the `*_on_batch`
calls), made alike by both doors: `DistributedModel`'s entry points and
`ShardingCallback.set_model`. It is the one owner of everything in force
while Keras's trainer runs, in one exit stack:

    entered, in this order                  left, in the reverse order
    0. the plan applied, if the model is built (before any scope)
    1. the run's callback-list handler      (plans the model Keras built)
    2. the executor's `scope(model)`        (backend state, failure report)
    3. exact backups (`BackupAndRestore`)
    4. the preemption watch (signals, stop agreement) and the stall watch,
       both on one heartbeat (one store request a second per process)
    5. the plan's `planned_scope(model)`, once a plan is applied (again
       when a newer plan is: the older one's left first)
    6. the door's own overrides (a callback's whole-file saving)

The plan is applied before Keras's loop: at once if the model is built, else
the moment Keras has built it, which is when Keras makes the run's callback
list (`fit`, `evaluate`, `predict`) or, for the `*_on_batch` calls, by
Keras's own build from the batch, called first here. One
path builds later, inside its first step (torch's `predict` of an unbuilt
model): the binding plans it there, through this run (`Binding.prepare`).

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
from keras_parallel.run.stall_watch import StallWatchPart


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
        # A built model is planned first, outside the scopes, as at `compile`
        # and as a `ShardingCallback` is handed it: a bad layout is refused
        # before anything is entered.
        binding.apply_if_changed(model)
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
            self.plan()
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

    def plan(self):
        """Applies the plan if the model's variables changed since the last,
        and puts the plan's `planned_scope` in force for the rest of the run.

        Returns:
            True if a new plan was applied.

        Raises:
            ShardingError: the distribution does not fit the model (nothing
                was moved).
        """
        applied = self.binding.apply_if_changed(self.model)
        if applied:
            # The older plan's scope is left before the newer's is entered.
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
            self.plan()

    def _leave_plan(self, error_type, error, traceback):
        planned, self._planned = self._planned, None
        if planned is not None:
            planned.__exit__(error_type, error, traceback)
        return False

    def _detach(self):
        self.binding.run = None
