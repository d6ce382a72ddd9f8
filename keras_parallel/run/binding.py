"""One distribution bound to one model: the machinery behind both doors.

`DistributedModel` (at `compile`) and `ShardingCallback` (at `set_model`) each
hold a `Binding`, so neither door holds logic the other lacks.
"""

from keras_parallel import report
from keras_parallel.auto import auto
from keras_parallel.auto import choice as auto_choice
from keras_parallel.backends import executor_class, resolve_plan_for
from keras_parallel.keras_seam.building import build_from_inputs, is_built
from keras_parallel.keras_seam.keras_compat import print_msg
from keras_parallel.keras_seam.overrides import HeldOverride
from keras_parallel.plan.sharding_plan import check_distribution, variables_signature


class Binding:
    """Applies one distribution to one model, for either door.

    The binding lasts as long as the model is distributed: it holds the plan
    and the saving the plan needs (from `apply_if_changed` to `release`).
    What is in force while an entry point runs is a `run.Run`'s, the one in
    `run` while it runs.

    Args:
        distribution: a `keras.distribution.Distribution`, or
            `keras_parallel.Auto` (`"auto"`): chosen when Keras builds the
            model from its first batch (`auto_choice.choose`).

    Raises:
        ShardingError: `distribution` is not a distribution, or this backend
            cannot run it.
    """

    def __init__(self, distribution):
        distribution = auto.as_auto(distribution)
        #: The `Auto` that chooses the distribution, or None.
        self.auto = distribution if isinstance(distribution, auto.Auto) else None
        #: What `Auto` chose, once it has.
        self.choice = None
        self._batch = None
        if self.auto is not None:
            auto.check_backend(executor_class())
            # Until the choice: the first candidate (every device), whose
            # executor runs the scopes entered before it.
            from keras_parallel.distribution import DataParallel

            distribution = DataParallel()
        check_distribution(distribution)
        self.distribution = distribution
        self.executor = executor_class()(distribution)
        self.executor.check(distribution)
        self.plan = None
        #: Counts the plans applied: a step compiled under an older one is remade.
        self.version = 0
        #: The `run.Run` in force, while an entry point runs.
        self.run = None
        self._signature = None
        #: The saving the applied plan needs (`Executor.saving_override`).
        self._saving = HeldOverride()
        self._announced = False
        self._hinted = False

    def resolve(self, model):
        """The plan for `model` as it is now, validated, applied to nothing."""
        return resolve_plan_for(self.distribution, model, self.executor)

    def prepare(self, model):
        """Plans and applies the distribution if the model's variables changed.

        Inside a run, through the run: the rest of it runs under the plan.

        Args:
            model: the `keras.Model`; nothing happens until it is built.

        Returns:
            True if a new plan was applied.

        Raises:
            ShardingError: the distribution does not fit the model. Nothing
                was moved.
        """
        if self.run is not None and self.run.model is model:
            return self.run.plan()
        return self.apply_if_changed(model)

    def apply_if_changed(self, model, entering=False):
        """Applies a new plan if the model's variables changed (`prepare`,
        outside a run's scopes). With `Auto`, chooses first: at the first
        entry point (`entering`: a `Run` begins), once the batch is known
        where the backend's prediction needs it (`batch_seen`)."""
        if not model.built:
            return False
        if self.unchosen():
            if not (entering or self.run is not None):
                return False  # Chosen at the first entry point.
            if self.needs_batch() and self._batch is None:
                return False  # Chosen once Keras builds from a batch.
            self._choose(model)
        signature = variables_signature(model)
        if signature == self._signature:
            return False
        plan = self.resolve(model)
        self.executor.apply(model, plan)
        self.plan = plan
        self._signature = signature
        self.version += 1
        start = self.executor.saving_override(model)
        if start is not None:
            self._saving.hold(start)
        self._hint_one_device()
        return True

    def unchosen(self):
        """Whether `Auto` has yet to choose the distribution."""
        return self.auto is not None and self.choice is None

    def needs_batch(self):
        """Whether `Auto` still waits for the batch to choose by (a backend
        whose prediction needs none: `AutoSupport.needs_batch`)."""
        return self.unchosen() and executor_class().auto_support.needs_batch

    def prediction_refused(self, model, name):
        """The `ValueError` for a prediction before `Auto` could choose
        (it chooses for the batch a model trains on: `needs_batch`)."""
        return ValueError(
            f"Auto chooses the distribution of model {model.name!r} for the "
            "batch it trains on, and has not chosen yet. Received: "
            f"{name}() before any fit, evaluate, train_on_batch or "
            "test_on_batch; train (or evaluate) first, or give the "
            "distribution itself. Nothing ran."
        )

    def batch_seen(self, batch):
        """Keeps the first batch Keras builds the model from (`first_batch`)."""
        if self._batch is None:
            self._batch = batch

    def _choose(self, model):
        devices = executor_class().list_devices()
        choice = auto_choice.choose_agreed(
            self.auto, model, self._batch, self.executor, devices
        )
        distribution = choice.chosen.distribution
        executor = executor_class()(distribution)
        executor.check(distribution)
        self.choice = self.auto.choice = choice
        self.distribution, self.executor = distribution, executor
        if executor.is_chief:
            print_msg(choice.table())

    def _hint_one_device(self):
        # On one device nothing is split and nothing else says so: printed
        # once whatever `verbose` says (only a verbose `fit` prints the plan).
        if self._hinted or not self.executor.is_chief:
            return
        hint = report.one_device_hint(self.plan, self.executor)
        if hint is not None:
            self._hinted = True
            print_msg(hint)

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
            elif kind != "predict" and self.needs_batch():
                wrapped = self._chosen_at_first_step(model, wrapped, kind)
            if wrapped is not function:
                wrapped._kp_wrapped = True
                setattr(model, name, wrapped)

    def _planned_at_first_step(self, model, function, kind):
        """`function`, building and planning an unbuilt model before its first step.

        Keras builds it only inside that step of torch's `predict` and of
        `predict_on_batch`.
        """

        def step(*args, **kwargs):
            if self.plan is None and self.run is not None and not is_built(model):
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

    def _chosen_at_first_step(self, model, function, kind):
        """`function`, choosing `Auto`'s distribution from its first batch.

        Through a `ShardingCallback`, Keras drew the batch it builds the
        model from before the run began: `Auto` chooses from the first
        step's batch instead, applies the plan, and the step is made again
        and run under it. No step has run before the choice.
        """

        def step(*args, **kwargs):
            if self.needs_batch() and self.run is not None:
                batch, args = self.executor.first_step_batch(kind, args)
                if batch is not None:
                    self.batch_seen(batch)

                    def replan():
                        self.run.plan()
                        setattr(model, f"{kind}_function", None)
                        getattr(model, f"make_{kind}_function")(force=True)
                        self.wrap_steps(model)

                    run = self.run
                    try:
                        args = self.executor.replanned_step_args(
                            model, kind, args, replan
                        )
                    except BaseException as error:
                        # Refused (nothing fits) before any step: the run
                        # ends now, with the error, as Keras calls no
                        # callback after a step raises.
                        run.__exit__(type(error), error, error.__traceback__)
                        raise
                    return getattr(model, f"{kind}_function")(*args, **kwargs)
            return function(*args, **kwargs)

        return step

    def announce(self, model, print_fn=print):
        """Prints the plan once (on the chief process), at the first `fit`."""
        if self._announced or self.plan is None or not self.executor.is_chief:
            return
        self._announced = True
        print_fn(report.format_plan(self.plan, model.name, self.executor))

    def release(self, model):
        """Returns the model to one device (ending a run left in force)."""
        if self.run is not None:
            self.run.close()
        self._saving.end()
        if self.plan is not None:
            self.executor.release(model)
        self.plan = None
        self._signature = None
