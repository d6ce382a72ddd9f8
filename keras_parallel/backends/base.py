"""The executor contract: what a backend must do to run a `ShardingPlan`.

An executor applies a resolved plan with the backend's own objects and
supplies Keras's own trainer through the hooks below; it holds no training
loop. The collectives return their input in one process; with several, a
backend must implement them (the defaults raise). See `docs/design.md`.
"""

import abc
import collections
import contextlib

from keras_parallel.backends.checkpoint_io import CheckpointIO
from keras_parallel.messages import wire

#: What `Executor.step_memory` returns: `peak`, the bytes one device holds
#: at a train step's peak; `moved`, the bytes one device sends in the step's
#: collectives; `note`, what the prediction leaves out, if anything.
StepMemory = collections.namedtuple("StepMemory", "peak moved note", defaults=(None,))


class AutoSupport:
    """What a backend does for `Auto`: its one declaration (`Executor.auto_support`).

    Args:
        candidate_kinds: the candidates it predicts beyond `DataParallel()`:
            `"shard"` (`DataParallel(shard=...)`), `"model"`
            (`ModelParallel` with `rules="auto"`). Empty: `DataParallel()`
            is the one candidate.
        needs_batch: whether its `step_memory` needs the batch (the choice
            waits for the batch Keras builds the model from), or only the
            model and optimizer.

    Example:

    ```python
    class JaxExecutor(Executor):
        auto_support = AutoSupport(candidate_kinds=("shard", "model"))
    ```
    """

    def __init__(self, candidate_kinds=(), needs_batch=True):
        self.candidate_kinds = tuple(candidate_kinds)
        self.needs_batch = needs_batch


class Executor(abc.ABC):
    """Applies a `ShardingPlan` to a model on one backend.

    The lifecycle, for one model and one distribution:

    1. `check(distribution)` when the distribution is given (at `compile`,
       or when a `ShardingCallback` is made): refuse what this backend
       cannot do, before anything is touched.
    2. `scope(model)` around every Keras entry point (`fit`, `evaluate`,
       `predict`, `*_on_batch`): what must be in force while Keras's trainer
       runs.
    3. `apply(model, plan)` inside it, once the model, its optimizer and
       metrics are built (as the run begins, or once Keras has built them),
       and again if the variables changed; then `planned_scope(model)`, for
       the rest of the entry point.
    4. `release(model)` when the model goes back to one device
       (`compile(distribution=None)`): undo `apply`.

    Args:
        distribution: the `keras.distribution.Distribution` to run.
    """

    #: The Keras backend this executor runs on (`"jax"`, `"torch"`, ...).
    backend = None

    #: The `CheckpointIO` subclass of this backend: how saving, backups and
    #: `restore_checkpoint` reach its values.
    checkpoint_io_class = CheckpointIO

    def __init__(self, distribution):
        self.distribution = distribution
        self.checkpoint_io = self.checkpoint_io_class(self)

    # ----------------------------------------------------------- devices
    @classmethod
    @abc.abstractmethod
    def list_devices(cls):
        """The device names one `DataParallel()` with no argument spans.

        Returns:
            A list of strings such as `["cpu:0", "cpu:1"]`.
        """

    def device_names(self, devices):
        """The mesh's devices (flattened: strings or backend device
        objects) as the names `list_devices` uses: a list of strings."""
        return [str(d).lower() for d in devices]

    def device_processes(self):
        """The process that holds each device of the mesh, in mesh order.

        Returns:
            A list of process indices, one per device; the default: one
            device per process (torch), or all in this one.
        """
        count = int(self.distribution.device_mesh.devices.size)
        if self.num_processes == count:
            return list(range(count))
        return [0] * count

    @classmethod
    def more_devices_hint(cls):
        """How to give this backend more than one device, as the end of a
        sentence (no full stop), for `report.one_device_hint`."""
        return "run where this backend sees several devices"

    @classmethod
    def creation_scope(cls, distribution):
        """What must be in force while variables are made in `scope()`.

        `distribution.scope()` of keras_parallel's `DataParallel` and
        `ModelParallel` enters it, after Keras's own scope: a backend whose
        Keras variables do not take their layout from the distribution as
        they are made (torch) places each one here, so that a model built
        in the scope is never whole on a device. The default: nothing (JAX
        asks `distribution.get_variable_layout` itself).

        Args:
            distribution: the distribution whose scope is entered.

        Returns:
            A context manager.
        """
        return contextlib.nullcontext()

    # -------------------------------------------------------------- Auto
    #: What this backend does for `Auto` (an `AutoSupport`), or None: it
    #: predicts no step's memory, and `Auto` is refused.
    auto_support = None

    @classmethod
    def device_memory(cls):
        """The bytes one device offers, or None where it reports none (a CPU)."""
        return None

    @classmethod
    def step_memory(cls, model, distribution, plan, batch):
        """The memory and traffic one train step takes of a device.

        Args:
            model: the built model, its optimizer and metrics built.
            distribution: the candidate distribution.
            plan: its `ShardingPlan` for `model`.
            batch: the global batch `(x, y, sample_weight)`.

        Returns:
            `(peak, moved)`: the bytes one device holds at the step's peak,
            and the bytes the step's collectives give it.
        """
        raise NotImplementedError(
            f"The {cls.backend} executor predicts no step's memory."
        )

    # --------------------------------------------------------- lifecycle
    def check(self, distribution):
        """Refuses a distribution this backend cannot run.

        Raises:
            ShardingError (or `NotImplementedError`), naming what to change.
        """

    @abc.abstractmethod
    def apply(self, model, plan):
        """Puts the model's variables where `plan` says.

        Called with the model, optimizer and metrics built. Must leave the
        model as it was if it raises.

        Args:
            model: the `keras.Model`.
            plan: the `ShardingPlan` resolved for it.
        """

    @contextlib.contextmanager
    def scope(self, model):
        """What must be in force while Keras's trainer runs an entry point.

        Entered around `fit`, `evaluate`, `predict` and the `*_on_batch`
        methods, whether or not a plan is applied yet (an unbuilt model is
        built inside the entry point); nested entries (the evaluation inside
        `fit`) are entered once. The default does nothing.
        """
        yield

    @contextlib.contextmanager
    def planned_scope(self, model):
        """What an applied plan needs in force while an entry point runs.

        Entered inside `scope`: when the entry point starts if a plan is
        applied by then, else the moment `apply` runs inside the entry
        point (the first `fit` of an unbuilt model, planned once Keras built
        it). When a newer plan is applied while it runs, the older plan's
        is left first and the newer's entered after `apply`. So whoever
        applies a plan, the rest of the entry point runs under it. The
        default does nothing.
        """
        yield

    def saving_override(self, model):
        """The saving this process's model needs for its distributed life.

        The binding holds it from `apply` to `release`, whichever door
        applied the plan: on processes other than 0, `model.save` writes
        nothing (`chief.chief_only_saving`); under torch `ModelParallel`,
        process 0 gathers the split variables first.

        Args:
            model: the model `apply` was just given.

        Returns:
            A function that puts the override in force and returns the function
            that ends it, or None (the default: nothing to override).
        """
        return None

    def build_from_batch(self, model, kind, batch):
        """Builds what is unbuilt of `model` from `batch`, as Keras's
        `*_on_batch` calls do first (`run.Run` then plans it).

        The default: Keras's own symbolic build for `train_on_batch` and
        `test_on_batch`; nothing for `predict_on_batch`, whose model Keras
        builds inside the first step on torch and TensorFlow (planned there,
        `step_inputs`).

        Args:
            model: the compiled model.
            kind: `"train"`, `"test"` or `"predict"`.
            batch: `(x, y, sample_weight)`.
        """
        if kind != "predict":
            model._symbolic_build(data_batch=batch)

    def release(self, model):
        """Undoes `apply`: the model runs on one device again."""

    def wrap_step(self, function, kind="train"):
        """Wraps a step function Keras made (`model.train_function`, ...).

        Called once per function, after Keras makes it and before it runs.
        The default returns `function` unchanged.

        Args:
            function: the function Keras's trainer calls once per step.
            kind: `"train"`, `"test"` or `"predict"`.

        Returns:
            The function to call instead.
        """
        return function

    @classmethod
    def first_step_batch(cls, kind, args):
        """The first batch a train or test step function was called with.

        `Auto` through a `ShardingCallback` chooses from it
        (`ShardingCallback._chosen_at_first_step`).

        Args:
            kind: `"train"` or `"test"`.
            args: the positional arguments the step function got.

        Returns:
            `(batch, args)`: the batch, or None where it cannot be read; and
            the arguments to call the step with (an iterator read from is
            given back whole).
        """
        return None, args

    @classmethod
    def replanned_step_args(cls, model, kind, args, replan):
        """Calls `replan()` (`Auto`'s choice made, the run begun, the step
        made again) and returns the arguments for the step it made. JAX
        hands the step the variables' values, taken out of the model: they
        are put back first, and taken again as the new plan laid them out.

        Args:
            model: the model.
            kind: `"train"` or `"test"`.
            args: the positional arguments the step function got.
            replan: applies the plan and makes the step again.
        """
        replan()
        return args

    def step_inputs(self, kind, args):
        """The model inputs of the batch a step function was called with.

        Where Keras builds an unbuilt model only inside the first step
        (torch's `predict`), the binding builds and plans it from these
        before the step runs.

        Args:
            kind: `"train"`, `"test"` or `"predict"`.
            args: the positional arguments the step function got.

        Returns:
            The inputs (`x`) of the first batch, or `None` where Keras builds
            the model before its step (the default).
        """
        return None

    #: Whether a model must be released (`release`) for plain Keras to run
    #: it right after a `ShardingCallback`'s run. JAX arrays and torch
    #: tensors placed by a plan run plainly as they are (and a model split
    #: over devices may not fit one); TensorFlow's metric variables of a
    #: strategy sum their replicas, which plain Keras does not expect.
    released_after_a_callback_run = False

    # ------------------------------------------------------- collectives
    @property
    def num_processes(self):
        return 1

    @property
    def process_index(self):
        return 0

    @property
    def is_chief(self):
        """Whether this process writes files and prints progress."""
        return self.process_index == 0

    def reduce(self, value, op="mean"):
        """Reduces `value` across processes (`"mean"` or `"sum"`).

        Raises:
            NotImplementedError: several processes run and this backend has
                no reduction (never silently this process's value).
        """
        self._single_process_only("reduce")
        return value

    def broadcast(self, value, src=0):
        """Returns process `src`'s `value` on every process.

        Backends implement `broadcast_bytes`; the value travels around it as
        data (`keras_parallel.messages.wire`: arrays, numbers, strings and nests of
        them), never pickled.
        """
        if self.num_processes == 1:
            return value
        payload = wire.encode(value) if self.process_index == src else b""
        return wire.decode(
            self.broadcast_bytes(payload, src), where=f"the broadcast of process {src}"
        )

    def broadcast_bytes(self, payload, src=0):
        """Returns process `src`'s `payload` (bytes) on every process.

        Raises:
            NotImplementedError: several processes run and this backend has
                no broadcast.
        """
        self._single_process_only("broadcast")
        return payload

    def barrier(self):
        """Waits until every process gets here."""
        self._single_process_only("barrier")

    def key_value_store(self):
        """The processes' key-value store: `set(key, value)`, `try_get(key)`.

        Not a collective: a process reads and writes it alone, while the
        others train (the preemption agreement's channel). Values are
        strings; `try_get` returns None for a key not written yet.

        Raises:
            NotImplementedError: several processes run and this backend has
                no store.
        """
        self._single_process_only("key-value store")
        return LocalStore()

    def chief_writes(self):
        """The run's `ChiefWrites` (what process 0 wrote, told to the
        others through the store), or None for one process."""
        if self.num_processes == 1:
            return None
        from keras_parallel.run.chief_writes import ChiefWrites

        return ChiefWrites(self.key_value_store(), self.is_chief)

    def share_host_random_state(self):
        """Gives every process process 0's host random state.

        Keras's data adapters draw each epoch's shuffle from it: every
        process must draw process 0's, the one a single process seeded as
        process 0 would. A collective: every process calls it, at the same
        point of the entry point.
        """
        if self.num_processes > 1:
            io = self.checkpoint_io
            io.set_host_random_state(self.broadcast(io.host_random_state()))

    def _single_process_only(self, collective):
        if self.num_processes > 1:
            raise NotImplementedError(
                f"The {self.backend} executor has no `{collective}` across "
                f"processes. Received: {self.num_processes} processes; "
                "report this as a keras_parallel bug."
            )


class LocalStore:
    """A key-value store of one process (a dict), for a run of one process."""

    def __init__(self):
        self._values = {}

    def set(self, key, value):
        self._values[key] = value

    def try_get(self, key):
        return self._values.get(key)
