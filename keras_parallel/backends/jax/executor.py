"""The JAX executor: `jax.sharding` placements under Keras's own JAX trainer.

Keras's JAX trainer already runs a distribution, but cannot lay out a model
whose variables exist, and keeps the distribution global. So `apply` moves
every variable to its planned `NamedSharding`, and `scope` installs a
`PlannedDistribution` only while an entry point runs, with the batch
placement of `batches` and, on CPU devices, one step at a time.
"""

import contextlib
import functools
import itertools
import weakref

import jax
import keras
from keras.distribution import TensorLayout

from keras_parallel.backends.base import AutoSupport, Executor
from keras_parallel.backends.jax import batches, processes
from keras_parallel.backends.jax.checkpoint_io import (
    JaxCheckpointIO,
    optimizer_and_metric_variables,
)
from keras_parallel.backends.jax.divided_input import DividedInput, adapter_replacements
from keras_parallel.backends.jax.keras_compat import DATA_ADAPTERS
from keras_parallel.backends.jax.keras_compat import (
    distribution_lib as keras_jax_distribution_lib,
)
from keras_parallel.backends.jax.keras_compat import trainer as keras_jax_trainer
from keras_parallel.backends.jax.planned_distribution import (
    PlannedDistribution,
    distribute_committed,
)
from keras_parallel.keras_seam.replacements import Replacements
from keras_parallel.messages import signed_store
from keras_parallel.plan.sharding_plan import iter_planned_variables
from keras_parallel.run import stall_watch
from keras_parallel.run.chief import (
    ChiefOnlyCallbacks,
    ChiefWritesInFit,
    process_saving,
)
from keras_parallel.run.stall_positions import EVERY_PROCESS


class JaxExecutor(Executor):
    """Runs a plan with `jax.sharding.NamedSharding` (see module docstring)."""

    backend = "jax"
    checkpoint_io_class = JaxCheckpointIO

    def __init__(self, distribution):
        super().__init__(distribution)
        self._planned = None
        self._model = None  # A weak reference to the planned model.
        #: Across processes, each process's share of the input.
        self.divided_input = None

    @classmethod
    def list_devices(cls):
        return keras.distribution.list_devices()

    @classmethod
    def more_devices_hint(cls):
        # JAX fixes its devices when it starts: the flag must come first.
        return (
            "run where JAX sees several GPUs or TPUs, or, on a CPU, set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX "
            "is imported (8 simulated devices)"
        )

    auto_support = AutoSupport(candidate_kinds=("shard", "model"))

    @classmethod
    def device_memory(cls):
        # A GPU or TPU reports its limit; a CPU reports nothing.
        stats = jax.devices()[0].memory_stats()
        return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None

    @classmethod
    def step_memory(cls, model, distribution, plan, batch):
        from keras_parallel.backends.jax.step_memory import step_memory

        return step_memory(model, distribution, plan, batch)

    def device_names(self, devices):
        return [
            f"{d.platform}:{d.id}" if isinstance(d, jax.Device) else str(d).lower()
            for d in devices
        ]

    def device_processes(self):
        mesh = self.distribution.device_mesh.backend_mesh  # jax Devices
        return [d.process_index for d in mesh.devices.flat]

    def apply(self, model, plan):
        mesh = self.distribution.device_mesh
        processes.check_same_plan(plan)
        planned = list(iter_planned_variables(model, plan))
        layouts = [TensorLayout(entry.axes, mesh) for _, entry in planned]
        values = [variable.value for variable, _ in planned]
        if processes.is_multi_process():
            # Every process built its own initial weights; process 0's win,
            # so the user need not seed every process alike. A variable made
            # in its planned layout already (in `distribution.scope()`) is
            # one array across the processes, each holding its own shards:
            # it is kept, never gathered whole.
            moving = [
                index
                for index, (value, layout) in enumerate(
                    zip(values, layouts, strict=True)
                )
                if not _laid_out_across_processes(value, layout.backend_layout)
            ]
            sent = processes.broadcast_values(
                [processes.fetch(values[index]) for index in moving]
            )
            for index, value in zip(moving, sent, strict=True):
                values[index] = value
        moves = []
        # Place every value first and assign after: a failure leaves the
        # model's variables as they were.
        for (variable, _), layout, value in zip(planned, layouts, values, strict=True):
            # An uncommitted array (one device, or made outside any scope)
            # is placed too: the step's outputs are committed, and a state
            # committed after the first step would compile the step again.
            if not (
                isinstance(value, jax.Array)
                and value.committed
                and value.sharding.is_equivalent_to(layout.backend_layout, value.ndim)
            ):
                value = processes.place(value, layout.backend_layout)
            moves.append((variable, layout, value))
        for variable, layout, value in moves:
            variable._layout = layout
            variable._value = value
        self._planned = PlannedDistribution(self.distribution, plan)
        self._model = weakref.ref(model)

    def build_from_batch(self, model, kind, batch):
        if kind != "predict":
            return super().build_from_batch(model, kind, batch)
        # Keras's JAX `predict_on_batch` builds an unbuilt model so, first.
        if not all(layer.built for layer in model._flatten_layers()):
            with keras.StatelessScope():
                model(batch[0])

    def saving_override(self, model):
        if not processes.is_multi_process():
            return None
        return process_saving(model, self, self.checkpoint_io.saving)

    @contextlib.contextmanager
    def planned_scope(self, model):
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(self._planned)
        replacements = Replacements()
        divided = None
        iterators = {
            (cls, "get_jax_iterator"): cls.get_jax_iterator for cls in DATA_ADAPTERS
        }
        if processes.is_multi_process():
            divided = self._divided_input()
            iterators = adapter_replacements(divided, DATA_ADAPTERS)
        for (cls, name), function in iterators.items():
            replacements.replace(cls, name, batches.refusing_sparse(function))
        lib = keras_jax_distribution_lib
        replacements.replace(
            lib,
            "distribute_tensor",
            functools.partial(distribute_committed, previous=lib.distribute_tensor),
        )
        replacements.replace(
            lib,
            "distribute_data_input",
            functools.partial(
                batches.distribute_batch,
                previous=lib.distribute_data_input,
                divided=divided,
            ),
        )
        jit = functools.partial(
            batches.jit_splitting_batches,
            previous=keras_jax_trainer.jit,
            batch_sharding=self._planned.batch_sharding(),
            donate=not self._on_cpu(),
        )
        replacements.replace(keras_jax_trainer, "jit", jit)
        chief_parts = []
        if processes.is_multi_process():
            # One shuffle for all processes: process 0's.
            self.share_host_random_state()
            chief_parts.append(ChiefWritesInFit(self.chief_writes(), model=model))
            if not self.is_chief:
                chief_parts.append(
                    ChiefOnlyCallbacks(collective_saving=True, model=model)
                )
            for part in chief_parts:
                part.install()
        try:
            yield
        finally:
            for part in reversed(chief_parts):
                part.uninstall()
            replacements.restore()
            keras.distribution.set_distribution(previous)

    def _divided_input(self):
        if self.divided_input is None:
            self.divided_input = DividedInput(self._planned)
        self.divided_input.distribution = self._planned
        return self.divided_input

    def _on_cpu(self):
        names = self.device_names(self.distribution.device_mesh.devices.flatten())
        return len(names) > 1 and all(name.startswith("cpu") for name in names)

    def wrap_step(self, function, kind="train"):
        if kind == "predict":
            function = batches.laid_out_inputs(function)
            if processes.is_multi_process():
                function = _gathered_predictions(function)
        model = self._model() if self._model is not None else None
        if model is not None:
            function = _state_kept_on_failure(function, model, kind)
        if not self._on_cpu():
            return function

        # XLA:CPU runs each simulated device on a thread and meets them at
        # every collective. When Keras dispatches the next step before the
        # last one finished, the steps' collectives can wait on each other
        # forever (seen here: "Expected 8 threads to join the rendezvous",
        # then an abort after 40 s, in Keras's fit and the guide's own loop
        # alike). Waiting for each step costs nothing measurable on a CPU,
        # which computes synchronously anyway; accelerators are untouched.
        def one_step_at_a_time(*args, **kwargs):
            outputs = function(*args, **kwargs)
            # Its batch in hand, this process waits for every other in the
            # step's collectives (a stall of another is named: stall_watch).
            with stall_watch.waiting_for(EVERY_PROCESS):
                _wait_for_step(outputs)
            return outputs

        return one_step_at_a_time

    @classmethod
    def first_step_batch(cls, kind, args):
        # Keras's JAX step functions take `(state, iterator)` and draw one
        # batch per step from the iterator: read, then handed back first.
        if len(args) < 2:
            return None, args
        iterator = iter(args[1])
        try:
            first = next(iterator)
        except StopIteration:
            return None, args
        return first, (args[0], itertools.chain([first], iterator), *args[2:])

    @classmethod
    def replanned_step_args(cls, model, kind, args, replan):
        owners = STATE_OWNERS[kind]
        # The values Keras took out of the model, put back for the plan
        # (and kept there if it refuses: the model is unchanged).
        for owner, values in zip(owners, args[0], strict=False):
            for variable, value in zip(
                _variables_of(model, owner), values, strict=False
            ):
                variable._value = value
        replan()
        # Taken out again as Keras does (`_purge_model_variables`), laid out
        # by the new plan.
        state = []
        for owner in owners:
            variables = _variables_of(model, owner)
            state.append([variable.value for variable in variables])
            for variable in variables:
                variable._value = None
        return (tuple(state), *args[1:])

    def release(self, model):
        device = jax.devices()[0]
        for variable in model.variables + optimizer_and_metric_variables(model):
            if getattr(variable, "_layout", None) is None:
                continue
            variable._layout = None
            variable._value = jax.device_put(processes.fetch(variable.value), device)
        self._planned = None
        self._model = None

    @property
    def num_processes(self):
        return jax.process_count()

    @property
    def process_index(self):
        return jax.process_index()

    def reduce(self, value, op="mean"):
        total = processes.reduce_sum(value)
        return total / self.num_processes if op == "mean" else total

    def broadcast_bytes(self, payload, src=0):
        return processes.broadcast_bytes(payload, src)

    def barrier(self):
        processes.barrier()

    def key_value_store(self):
        if not processes.is_multi_process():
            return super().key_value_store()
        return signed_store.for_run(processes.CoordinationStore(), self.process_index)


def _laid_out_across_processes(value, sharding):
    """Whether `value` is a global array laid out by `sharding` already."""
    return (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and value.sharding.is_equivalent_to(sharding, value.ndim)
    )


#: The variables of the state Keras's JAX step functions take, in order.
STATE_OWNERS = {
    "train": ("trainable", "non_trainable", "optimizer", "metrics"),
    "test": ("trainable", "non_trainable", "metrics"),
    "predict": ("trainable", "non_trainable"),
}


def _state_kept_on_failure(function, model, kind):
    """Keras's step, the model's variables given back if it raises.

    Keras's JAX trainer takes the variables' values out of the model (sets
    them to None) before the first step and puts them back when the loop
    ends: a step that raises (a batch refused before it is placed, a rank
    that failed) would leave a model whose every variable is empty. The
    values the step was handed are put back, unless the step consumed them
    (donated to a computation that then failed).
    """
    owners = STATE_OWNERS[kind]

    def step(state, *args, **kwargs):
        try:
            return function(state, *args, **kwargs)
        except BaseException:
            for owner, values in zip(owners, state, strict=False):
                for variable, value in zip(
                    _variables_of(model, owner), values, strict=False
                ):
                    alive = not (isinstance(value, jax.Array) and value.is_deleted())
                    if variable._value is None and alive:
                        variable._value = value
            raise

    return step


def _variables_of(model, owner):
    if owner == "optimizer":
        return model.optimizer.variables
    return getattr(model, f"{owner}_variables")


def _gathered_predictions(function):
    """Keras's predict step, its predictions whole on every process.

    Across processes the predictions are split over the data axis, so no
    process could read them; Keras's predict loop reads them on the host.
    """

    def gathered(*args, **kwargs):
        outputs, state = function(*args, **kwargs)
        return jax.tree_util.tree_map(processes.fetch, outputs), state

    return gathered


def _wait_for_step(outputs):
    """Waits until the step that made `outputs` has finished on every device.

    One output array is enough: an array on the mesh has a shard on each of
    its devices, and a device's outputs are all ready once its part of the
    step is. The first one is the step's logs (or predictions), which the
    step computes, never an input passed through. Waiting on all ~50
    outputs instead (`jax.block_until_ready(outputs)`) cost 0.3 to 0.5 ms
    of host CPU per step here, 1 to 2 % of a step of the guide's convnet at
    batch 64 (benchmarks/bench_jax.py): the guide's loop waits on its loss
    alone.
    """
    for leaf in jax.tree_util.tree_leaves(outputs):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()
            return
