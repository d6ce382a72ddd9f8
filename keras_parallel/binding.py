"""One distribution bound to one model: the machinery behind both doors.

`DistributedModel` (at `compile`) and `ShardingCallback` (at `set_model`) each
hold a `Binding`, so neither door holds logic the other lacks.
"""

import contextlib

from keras_parallel import callback_lists, report
from keras_parallel.backends import executor_class, resolve_plan_for
from keras_parallel.building import build_from_inputs, is_built
from keras_parallel.keras_compat import print_msg
from keras_parallel.persistence.backup import ExactBackups
from keras_parallel.persistence.preemption import PreemptionWatch
from keras_parallel.plan import check_distribution, variables_signature


class Binding:
    """Applies one distribution to one model, for either door.

    Args:
        distribution: a `keras.distribution.Distribution`.

    Raises:
        ShardingError: `distribution` is not a distribution, or this backend
            cannot run it.
    """

    def __init__(self, distribution):
        check_distribution(distribution)
        self.distribution = distribution
        self.executor = executor_class()(distribution)
        self.executor.check(distribution)
        self.plan = None
        #: Counts the plans applied: a step compiled under an older one is remade.
        self.version = 0
        self._signature = None
        self._depth = 0
        self._scope = None
        #: The executor's `planned_scope`, while an entry point runs under a plan.
        self._planned_scope = None
        self._announced = False
        self._hinted = False

    def resolve(self, model):
        """The plan for `model` as it is now, validated, applied to nothing."""
        return resolve_plan_for(self.distribution, model, self.executor)

    def prepare(self, model):
        """Plans and applies the distribution if the model's variables changed.

        Args:
            model: the `keras.Model`; nothing happens until it is built.

        Returns:
            True if a new plan was applied.

        Raises:
            ShardingError: the distribution does not fit the model. Nothing
                was moved.
        """
        if not model.built:
            return False
        signature = variables_signature(model)
        if signature == self._signature:
            return False
        plan = self.resolve(model)
        # A plan applied mid-run (an unbuilt model's first `fit` builds it
        # inside Keras's trainer) must be in force for the rest of the run.
        self._leave_planned_scope()
        self.executor.apply(model, plan)
        self.plan = plan
        self._signature = signature
        self.version += 1
        self._hint_one_device()
        if self.active:
            self._enter_planned_scope(model)
        return True

    def _hint_one_device(self):
        # On one device nothing is split and nothing else says so: printed
        # once whatever `verbose` says (only a verbose `fit` prints the plan).
        if self._hinted or not self.executor.is_chief:
            return
        hint = report.one_device_hint(self.plan, self.executor)
        if hint is not None:
            self._hinted = True
            print_msg(hint)

    def _enter_planned_scope(self, model):
        scope = contextlib.ExitStack()
        scope.enter_context(self.executor.planned_scope(model))
        self._planned_scope = scope

    def _leave_planned_scope(self, error=None):
        scope, self._planned_scope = self._planned_scope, None
        if scope is None:
            return
        if error is None:
            scope.close()
        else:
            scope.__exit__(type(error), error, error.__traceback__)

    def wrap_steps(self, model):
        """Lets the executor wrap the step functions Keras made, once each."""
        for name in ("train_function", "test_function", "predict_function"):
            function = getattr(model, name, None)
            if function is None or getattr(function, "_kp_wrapped", False):
                continue
            kind = name.split("_")[0]
            wrapped = self.executor.wrap_step(function, kind=kind)
            if kind == "predict" and self.plan is None:
                wrapped = self._planned_at_first_step(model, wrapped, kind)
            if wrapped is not function:
                wrapped._kp_wrapped = True
                setattr(model, name, wrapped)

    def _planned_at_first_step(self, model, function, kind):
        """`function`, building and planning an unbuilt model before its first step.

        Keras builds it only inside that step of torch's `predict` and of
        `predict_on_batch`.
        """

        def step(*args, **kwargs):
            if self.plan is None and self.active and not is_built(model):
                inputs = self.executor.step_inputs(kind, args)
                if inputs is not None:
                    build_from_inputs(model, inputs)
                    if self.prepare(model):
                        # Keras 3.16 binds `predict_step` as it makes the
                        # function: made again, it runs the planned step.
                        model.make_predict_function(force=True)
                        self.wrap_steps(model)
                        return model.predict_function(*args, **kwargs)
            return function(*args, **kwargs)

        return step

    def announce(self, model, print_fn=print):
        """Prints the plan once (on the chief process), at the first `fit`."""
        if self._announced or self.plan is None or not self.executor.is_chief:
            return
        self._announced = True
        print_fn(report.format_plan(self.plan, model.name, self.executor))

    def enter(self, model):
        """Enters the executor's scope, once for nested entry points."""
        self._depth += 1
        if self._depth == 1:
            self._scope = contextlib.ExitStack()
            try:
                # A plan applied inside this run finds the run's callbacks.
                self._scope.callback(callback_lists.track_lists())
                self._scope.enter_context(self.executor.scope(model))
                backups = ExactBackups(self.executor)
                backups.install()
                self._scope.callback(backups.uninstall)
                self._scope.enter_context(PreemptionWatch(self.executor))
                if self.plan is not None:
                    self._enter_planned_scope(model)
            except BaseException as error:
                self._depth = 0
                scope, self._scope = self._scope, None
                scope.__exit__(type(error), error, error.__traceback__)
                raise

    def exit(self, model, error=None):
        """Leaves what `enter` entered, when the outermost entry point ends.

        Args:
            model: the model.
            error: the exception the entry point raises, if any: the scope then
                runs no collective, which the other processes may never reach.
        """
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            scope, self._scope = self._scope, None
            try:
                self._leave_planned_scope(error)
            finally:
                if error is None:
                    scope.close()
                else:
                    scope.__exit__(type(error), error, error.__traceback__)

    @property
    def active(self):
        return self._depth > 0

    @contextlib.contextmanager
    def running(self, model):
        """`enter` ... `exit` as a context manager."""
        self.enter(model)
        try:
            yield
        except BaseException as error:
            self.exit(model, error)
            raise
        self.exit(model)

    def release(self, model):
        """Returns the model to one device."""
        while self._depth:
            self.exit(model)
        if self.plan is not None:
            self.executor.release(model)
        self.plan = None
        self._signature = None
