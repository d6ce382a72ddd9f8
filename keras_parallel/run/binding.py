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
    and the saving the plan needs (from `apply` to `release`).
    What is in force while an entry point runs is a `run.Run`'s, the one in
    `run` while it runs.

    With `Auto`, the binding holds no distribution and no executor until
    `choose` (each door calls it before its first run, once it knows what
    the choice needs): a run is made for the chosen distribution only.

    Args:
        distribution: a `keras.distribution.Distribution`, or
            `keras_parallel.Auto` (`"auto"`).

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
        self.distribution = self.executor = None
        if self.auto is None:
            self._use(distribution)
        else:
            auto.check_backend(executor_class())
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

    def _use(self, distribution):
        check_distribution(distribution)
        executor = executor_class()(distribution)
        executor.check(distribution)
        self.distribution, self.executor = distribution, executor

    def resolve(self, model):
        """The plan for `model` as it is now, validated, applied to nothing."""
        return resolve_plan_for(self.distribution, model, self.executor)

    def apply(self, model):
        """Applies a new plan if the model's variables changed; nothing
        before `Auto` has chosen or while the model is unbuilt.

        `compile` calls it for a built model, a run (`Run` plans as it
        begins and once Keras has built the model), and reading an Orbax
        checkpoint into the plan's layouts; nothing else plans.

        Args:
            model: the `keras.Model`.

        Returns:
            True if a new plan was applied.

        Raises:
            ShardingError: the distribution does not fit the model. Nothing
                was moved.
        """
        if not model.built or self.unchosen():
            return False
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

    def choose(self, model, batch=None):
        """`Auto`'s step: chooses the distribution, before any run.

        Every process predicts alike (or takes process 0's table): see
        `auto_choice.choose_agreed`. The chief prints the table.

        Args:
            model: the built model, its optimizer and metrics built.
            batch: the global batch the model trains on (arrays or specs),
                where the backend's prediction needs it
                (`AutoSupport.needs_batch`).

        Raises:
            ValueError: no candidate fits (nothing was moved), or the model
                is not built where the choice needs it.
        """
        cls = executor_class()
        if not model.built:
            raise ValueError(
                f"Auto chooses the distribution of model {model.name!r} from "
                "its variables, and the model is not built. Received: an "
                f"unbuilt model on the {cls.backend} backend; build it first "
                "(call it on a batch, or model.build(input_shape)), or give "
                "the distribution itself. Nothing ran."
            )
        choice = auto_choice.choose_agreed(
            self.auto, model, batch, cls, cls.list_devices()
        )
        self._use(choice.chosen.distribution)
        self.choice = self.auto.choice = choice
        if self.executor.is_chief:
            print_msg(choice.table())

    def prediction_refused(self, model, name):
        """The `ValueError` for a prediction before `Auto` could choose
        (it chooses for the batch a model trains on)."""
        return ValueError(
            f"Auto chooses the distribution of model {model.name!r} for the "
            "batch it trains on, and has not chosen yet. Received: "
            f"{name}() before any fit, evaluate, train_on_batch or "
            "test_on_batch; train (or evaluate) first, or give the "
            "distribution itself. Nothing ran."
        )

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
                    if self.run.model_built():
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

    def release(self, model):
        """Returns the model to one device (ending a run left in force)."""
        if self.run is not None:
            self.run.close()
        self._saving.end()
        if self.plan is not None:
            self.executor.release(model)
        self.plan = None
        self._signature = None
