"""The TensorFlow executor: `DataParallel` through `tf.distribute.MirroredStrategy`.

Keras's TensorFlow trainer runs under a strategy, but needs the variables
created under its scope. So `apply` re-creates them there, values kept
(`variables`), `scope` enters the strategy and makes uneven batches exact
(`exact`), and `release` brings back plain one-device variables. Across
workers the strategy is `workers`'. `ModelParallel` is refused in `check`.
"""

import contextlib

import numpy as np
import tensorflow as tf
from keras.distribution import DataParallel

from keras_parallel.backends.base import AutoSupport, Executor
from keras_parallel.backends.tensorflow import devices as tf_devices
from keras_parallel.backends.tensorflow import exact as tf_exact
from keras_parallel.backends.tensorflow import saving_references, strategies
from keras_parallel.backends.tensorflow import variables as tf_variables
from keras_parallel.backends.tensorflow import workers as tf_workers
from keras_parallel.backends.tensorflow.divided_input import (
    DividedInput,
    adapter_replacements,
)
from keras_parallel.backends.tensorflow.keras_compat import (
    DATA_ADAPTERS,
    ArrayDataAdapter,
)
from keras_parallel.errors import ShardingError
from keras_parallel.keras_seam.replacements import replaced
from keras_parallel.messages import signed_store
from keras_parallel.run.chief import (
    ChiefOnlyCallbacks,
    ChiefWritesInFit,
    process_saving,
)


class TensorFlowExecutor(Executor):
    """Runs a data-parallel plan under a `MirroredStrategy` (see module docstring).

    Args:
        distribution: a `keras.distribution.DataParallel` over local devices.

    Example:

    ```python
    model.compile(optimizer="sgd", loss="mse",
                  distribution=keras_parallel.DataParallel())  # all GPUs
    model.fit(x, y, batch_size=64)  # the global batch, split over the GPUs
    ```
    """

    backend = "tensorflow"

    def __init__(self, distribution):
        super().__init__(distribution)
        self.strategy = None
        self._devices = None
        self._applied = False
        #: Across workers, how each worker prepares only its share of the
        #: input (`divided_input`); None in one process.
        self.divided_input = None

    # ----------------------------------------------------------- devices
    @classmethod
    def list_devices(cls):
        workers = _workers()
        if workers is not None:
            return workers.global_devices()
        return tf_devices.local_devices()

    def device_processes(self):
        return [tf_workers.worker_of(d) for d in self._mesh_devices()]

    def device_names(self, devices):
        return [tf_devices.normalize(d) for d in devices]

    @classmethod
    def more_devices_hint(cls):
        # TensorFlow fixes its devices when its runtime starts.
        return (
            "run where TensorFlow sees several GPUs, or, on a CPU, call "
            "keras_parallel.split_cpu(8) before TensorFlow runs anything "
            "(8 logical devices)"
        )

    # -------------------------------------------------------------- Auto
    #: TensorFlow runs data parallelism alone, `Auto`'s one candidate; its
    #: need is the state and the gradients: no batch needed.
    auto_support = AutoSupport(candidate_kinds=(), needs_batch=False)

    @classmethod
    def step_memory(cls, model, distribution, plan, batch):
        from keras_parallel.backends.tensorflow.step_memory import step_memory

        return step_memory(model, plan)

    # --------------------------------------------------------- lifecycle
    def check(self, distribution):
        if not isinstance(distribution, DataParallel) or getattr(
            distribution, "_layout_map", None
        ):
            raise ShardingError(
                "keras_parallel runs only DataParallel on the TensorFlow "
                "backend (through tf.distribute.MirroredStrategy); "
                "ModelParallel and other layouts of variables are available "
                "on the JAX and torch backends. Received: distribution="
                f"{type(distribution).__name__} with KERAS_BACKEND="
                "'tensorflow'; use keras_parallel.DataParallel(), or set "
                "KERAS_BACKEND=jax (or torch) to shard variables."
            )
        shard = getattr(distribution, "shard", None)
        if shard is not None:
            raise ShardingError(
                "`shard=` (variables or optimizer state split over the "
                "devices) runs on the JAX and torch backends; TensorFlow's "
                "tf.distribute keeps whole variables on every device. "
                f"Received: shard={shard!r} with KERAS_BACKEND='tensorflow'; "
                "use keras_parallel.DataParallel() (shard=None) here, or set "
                "KERAS_BACKEND=jax (or torch) to shard."
            )
        axes = tuple(distribution.device_mesh.axis_names)
        if len(axes) != 1:
            raise ShardingError(
                "DataParallel on TensorFlow needs a one-dimensional device "
                f"mesh. Received: mesh shape={distribution.device_mesh.shape},"
                f" axis_names={list(axes)}; pass `devices=` or a 1D "
                "DeviceMesh."
            )
        workers = _workers()
        if workers is not None:
            devices = np.asarray(distribution.device_mesh.devices).flat
            mesh = sorted(self.device_names(list(devices)))
            if mesh != sorted(workers.global_devices()):
                raise ShardingError(
                    "Across TensorFlow workers, DataParallel spans every device "
                    "of every worker (MultiWorkerMirroredStrategy has no "
                    f"subsets). Received: devices={mesh}; use "
                    "keras_parallel.DataParallel() with no argument."
                )

    def apply(self, model, plan):
        strategy = self._strategy_for(plan.devices)
        # A model built inside `scope` (first fit of an unbuilt model) already
        # has its variables under this strategy: only the others are moved.
        # Across workers, variables created under the strategy take worker
        # 0's initial values (the strategy broadcasts them).
        tf_variables.move_variables(model, strategy)
        _attach(model, strategy)
        self._applied = True

    def saving_override(self, model):
        if self.num_processes == 1:
            return None
        return process_saving(model, self)

    def build_from_batch(self, model, kind, batch):
        # Under the model's strategy (`scope` attached it), as Keras's own.
        if kind != "predict":
            model._maybe_symbolic_build(data_batch=batch)

    @contextlib.contextmanager
    def scope(self, model):
        strategy = self._strategy_for(self._mesh_devices())
        attached = getattr(model, "_distribute_strategy", None) is strategy
        if not attached:
            # Not applied yet (an unbuilt model): Keras builds it under the
            # model's strategy, so its variables are born mirrored.
            previous = _detach_state(model)
            _attach(model, strategy)
        try:
            # In the strategy's scope, metric states read as their sum over
            # replicas, and variables created lazily are mirrored. A save
            # from a callback (worker 0 alone) must make no variable there.
            with (
                saving_references.made_outside(),
                strategy.scope(),
                tf_exact.patched(model),
                self._workers_scope(model),
            ):
                yield
        finally:
            if not attached and not self._applied:
                # Nothing was applied (the run failed before the model was
                # built): leave the model as it came.
                _restore_state(model, previous)

    def step_inputs(self, kind, args):
        # `predict_on_batch` calls the step with `[(x,)]`; `predict` hands
        # an iterator (its model is built in `element_spec_build.late_distribution`).
        data = args[0] if args else None
        if kind == "predict" and isinstance(data, list) and data:
            return data[0][0]
        return None

    @contextlib.contextmanager
    def _workers_scope(self, model):
        """Across workers: one shuffle (worker 0's), progress on worker 0."""
        workers = _workers()
        if workers is None:
            yield
            return
        self.share_host_random_state()
        if self.divided_input is None:
            store = signed_store.for_run(
                tf_workers.CoordinationStore(), self.process_index
            )
            self.divided_input = DividedInput(workers, store)
        chief_parts = [ChiefWritesInFit(self.chief_writes(), model=model)]
        if not self.is_chief:
            chief_parts.append(ChiefOnlyCallbacks())
        for part in chief_parts:
            part.install()
        try:
            with (
                tf_workers.numpy_shuffles(ArrayDataAdapter),
                replaced(adapter_replacements(self.divided_input, DATA_ADAPTERS)),
            ):
                yield
        finally:
            # Readers still waiting for a worker's rows give up (an error
            # or a preemption ended the entry point mid-epoch).
            self.divided_input.close()
            for part in reversed(chief_parts):
                part.uninstall()

    released_after_a_callback_run = True

    def release(self, model):
        tf_variables.move_variables(model, None)
        _restore_state(model, (None, tf.distribute.get_strategy()))
        self._applied = False

    # ------------------------------------------------------- collectives
    @property
    def num_processes(self):
        workers = _workers()
        return 1 if workers is None else workers.num_workers

    @property
    def process_index(self):
        workers = _workers()
        return 0 if workers is None else workers.worker_index

    def reduce(self, value, op="mean"):
        workers = _workers()
        if workers is None:
            return value
        total = tf_workers.sum_over_workers(workers, value)
        return total / self.num_processes if op == "mean" else total

    def broadcast_bytes(self, payload, src=0):
        workers = _workers()
        if workers is None:
            return payload
        return tf_workers.broadcast_bytes(workers, payload, src)

    def barrier(self):
        workers = _workers()
        if workers is not None:
            tf_workers.sum_over_workers(workers, 0.0)

    def key_value_store(self):
        if _workers() is None:
            return super().key_value_store()
        return signed_store.for_run(tf_workers.CoordinationStore(), self.process_index)

    # ----------------------------------------------------------- helpers
    def _mesh_devices(self):
        devices = np.asarray(self.distribution.device_mesh.devices).flat
        return tuple(self.device_names(list(devices)))

    def _strategy_for(self, devices):
        workers = _workers()
        if workers is not None:
            self.strategy = workers  # Its devices were checked in `check`.
            return workers
        devices = tuple(devices)
        if self.strategy is None or devices != self._devices:
            self.strategy = strategies.strategy_for(
                [_tf_device_name(d) for d in devices]
            )
            self._devices = devices
        return self.strategy


def _workers():
    """The multi-worker strategy `TF_CONFIG` asks for, else `None`.

    Made here if the bootstrap did not (a script started otherwise), which
    works only before TensorFlow ran anything.
    """
    if tf_workers.strategy() is None and tf_workers.wanted():
        tf_workers.initialize_from_environment()
    return tf_workers.strategy()


def _tf_device_name(name):
    kind, _, index = name.partition(":")
    return f"/device:{kind.upper()}:{index}"


def _attach(model, strategy):
    """Tells Keras's trainer and optimizer which strategy they run under."""
    model._distribute_strategy = strategy
    optimizer = getattr(model, "optimizer", None)
    for o in tf_variables._optimizers_of(model) if optimizer is not None else []:
        o._distribution_strategy = strategy


def _detach_state(model):
    optimizer = getattr(model, "optimizer", None)
    return (
        getattr(model, "_distribute_strategy", None),
        getattr(optimizer, "_distribution_strategy", None),
    )


def _restore_state(model, state):
    model_strategy, optimizer_strategy = state
    model._distribute_strategy = model_strategy
    if optimizer_strategy is not None:
        for o in tf_variables._optimizers_of(model):
            o._distribution_strategy = optimizer_strategy
