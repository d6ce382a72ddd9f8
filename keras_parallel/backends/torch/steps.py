"""What each rank does inside Keras's own torch steps (docs/torch.md).

In one step a rank takes its rows, runs the forward pass through DDP with its
output gradient scaled by its share of the rows (so an uneven batch gives the
global mean's gradient), makes the metrics global, and gathers `predict`'s rows.
"""

import contextlib

import torch

from keras_parallel.backends.torch import batches as rows_of
from keras_parallel.backends.torch import group as torch_group
from keras_parallel.backends.torch.accumulation import AccumulatedGradients
from keras_parallel.backends.torch.divided_input import DividedInput
from keras_parallel.backends.torch.flat_buffers import broadcast_flat
from keras_parallel.backends.torch.gradient_mean import GradientMean
from keras_parallel.backends.torch.keras_compat import (
    TorchEpochIterator,
    keras_step,
    local_metrics_result,
    tree,
)
from keras_parallel.backends.torch.metric_states import MetricStates
from keras_parallel.backends.torch.random_stream import RankRandomStream
from keras_parallel.backends.torch.same_data import SameDataCheck, model_runs
from keras_parallel.backends.torch.step_logs import ReturnedLogs
from keras_parallel.backends.torch.step_metrics import NO_ROWS, StepMetrics, StepRows
from keras_parallel.backends.torch.trainer import TorchTrainer
from keras_parallel.backends.torch.update_weights import weighted_per_step_updates
from keras_parallel.keras_seam.overrides import override
from keras_parallel.keras_seam.replacements import Replacements


class RankSteps:
    """Wraps one model's own train/test/predict steps while an entry point runs.

    Args:
        ddp: the `DistributedDataParallel` of `DDPModule(model)`, or None.
    """

    #: Whether each rank loads only its rows of a batch (`divided_input`).
    divides_input = True

    #: Whether gradients are averaged here (DDP or `GradientMean`).
    reduces_gradients = True

    #: The model's methods while it runs (`keras_seam/overrides.py`).
    trainer = TorchTrainer

    def __init__(self, model, ddp, world_size, rank, make_ddp=None):
        self.model = model
        self.ddp = ddp
        #: Makes DDP once every variable had a gradient (`GradientMean` until then).
        self.make_ddp = make_ddp
        self.gradient_mean = GradientMean(model, world_size)
        self.world_size = world_size
        self.rank = rank
        self._installed = False
        self._replacements = Replacements()
        self._end_override = None
        self._own_call = None
        self._routing = False
        self._grad_scale = 1.0
        #: The metrics' global results (`step_metrics`), made at `install`.
        self.metrics = None
        self._metric_states = MetricStates(model, rank)
        self._same_data = SameDataCheck(model, world_size, rank)
        self.divided_input = DividedInput(world_size, rank)
        #: The rows of the step running, or of the latest.
        self.step_rows = NO_ROWS
        self._step = 0
        self._random_stream = RankRandomStream(rank)
        #: Gradient accumulation: no all-reduce on micro-steps (DDP only).
        self.accumulation = AccumulatedGradients(model, world_size)
        #: After a train step: non-trainable variables may differ across ranks.
        self.dirty = False

    # -------------------------------------------------------- install
    def install(self):
        if self._installed:
            return
        model = self.model
        # The model's own methods, read before the trainer's replace them
        # (`trainer.TorchTrainer`).
        self._own_call = self._forward(model.call)
        previous = self.metrics
        self.metrics = StepMetrics(
            self._metric_states,
            self.world_size,
            self._counts,
            local_metrics_result(model),
        )
        if previous is not None:
            # A run's step-log choice holds until the next run's (`step_logs`).
            self.metrics.latest = previous.latest
        self._keras_steps = {
            kind: keras_step(model, f"{kind}_step") for kind in ("train", "test")
        }
        # What the model's methods are while it runs (`TorchTrainer`).
        self.train_step = self._wrap(model.train_step, "train")
        self.test_step = self._wrap(model.test_step, "test")
        self.predict_step = self._wrap(model.predict_step, "predict")
        self._get_metrics_result_or_logs = self.metrics.epoch_logs(
            model._get_metrics_result_or_logs
        )
        self._end_override = override(model, self.trainer(self))
        self._replacements.replace(
            TorchEpochIterator,
            "__iter__",
            self._same_data.epoch_begins(TorchEpochIterator),
        )
        if self.divides_input:
            self._replacements.replace(
                TorchEpochIterator,
                "_get_iterator",
                self._divided_batches(TorchEpochIterator._get_iterator),
            )
        self._install_gradient_reduction()
        self._step = 0
        self._installed = True

    def uninstall(self):
        if not self._installed:
            return
        self._routing = False
        self._uninstall_gradient_reduction()
        self._replacements.restore()
        end_override, self._end_override = self._end_override, None
        end_override()
        self._installed = False

    def use_ddp(self, ddp, make_ddp=None):
        """Reduces gradients with `ddp` from now on (None: `GradientMean`)."""
        if self._installed:
            self._uninstall_gradient_reduction()
        self.ddp, self.make_ddp = ddp, make_ddp
        if self._installed:
            self._install_gradient_reduction()

    def _install_gradient_reduction(self):
        if self.ddp is not None:
            self.accumulation.install()
        elif self.reduces_gradients:
            self.gradient_mean.install()

    def _uninstall_gradient_reduction(self):
        self.accumulation.uninstall()
        self.gradient_mean.uninstall()

    def _ddp_once_every_variable_is_used(self):
        # Alike on every rank: from the all-reduce of the gradient counts.
        if self.make_ddp is None or self.ddp is not None:
            return
        if self.gradient_mean.all_used:
            self.use_ddp(self.make_ddp())
        elif self.gradient_mean.all_used is False:
            self.make_ddp = None  # Unused variables: GradientMean stays.

    def set_global_step_logs(self, on):
        """Whether each step's logs are made global (`step_logs`)."""
        self.metrics.set_global_step_logs(on)

    @property
    def whole(self):
        """Whether every rank computes the step's whole batch."""
        return self.step_rows.whole

    # ---------------------------------------------------------- steps
    def _wrap(self, step, kind):
        def rank_step(data):
            where = f"{kind} step {self._step}"
            try:
                return self._run(step, kind, data)
            except torch_group.PeerFailedError:
                raise
            except Exception as error:
                if torch_group.is_collective_failure(error):
                    raise torch_group.peer_failed_error(
                        error, self.rank, where
                    ) from error
                torch_group.publish_failure(self.rank, error)
                raise
            finally:
                self._step += 1

        rank_step.__name__ = f"keras_parallel_{kind}_step"
        return rank_step

    def _divided_batches(self, keras_get_iterator):
        divided = self.divided_input

        def get_iterator(iterator):
            loader = keras_get_iterator(iterator)
            if model_runs.get(iterator) is not self.model:
                return loader
            return divided.batches(loader, getattr(iterator, "data_adapter", None))

        return get_iterator

    def _run(self, step, kind, data):
        global_rows = self.divided_input.global_rows(data)
        rows = rows_of.batch_rows(data) if global_rows is None else global_rows
        if rows is None:
            return step(data)
        if kind == "train" and self._step == 0:
            self._check_batch(rows)
        if kind != "train" and self.dirty:
            self.sync_non_trainable()
        own = self.step_rows = self._rows(rows)
        local = data  # Whole, or divided input: this rank's rows already.
        if global_rows is None and not own.whole:
            local = rows_of.slice_rows(data, rows, own.start, own.stop)
        routed = self._routes(kind)
        metrics = self.metrics
        if kind == "predict":
            self._route_call(routed)
            try:
                with metrics.step(own):
                    outputs = step(local)
            finally:
                self._route_call(False)
            return outputs if own.whole else self._gather(outputs, rows)
        states = metrics.states
        states.start()
        # A batch computed by several ranks is counted by one.
        lazy_skip = not self._counts(own) and not metrics.global_step_logs
        before_step = states.snapshot() if lazy_skip else None
        # Divided batches differ by design: only their sizes are compared.
        states.saw(rows, data if global_rows is None else None)
        if kind == "train":
            self.dirty = True
            self._grad_scale = self._scale(own)
        self._route_call(routed)
        try:
            with (
                metrics.step(own),
                self._context(kind),
                self._per_step_weights(kind, own),
            ):
                logs = step(local)
        finally:
            self._route_call(False)
        if kind == "train":
            self._ddp_once_every_variable_is_used()
        returned = None
        if isinstance(logs, dict) and not self._keras_steps.get(kind, False):
            # Read before a non-counting rank's metric state is put back.
            rows_counted = (own.stop - own.start) if self._counts(own) else 0
            returned = ReturnedLogs(logs, self.model.metrics, rows_counted)
        if before_step is not None:
            states.restore(before_step)
        if returned is not None and metrics.global_step_logs:
            return metrics.global_logs(returned)
        if returned is not None:
            # Made global when Keras reads the epoch's logs (`epoch_logs`).
            metrics.keep_returned(returned)
        if metrics.global_step_logs and states.pending:
            # A custom step that never asked for the metrics' results.
            metrics.reduce()
        return logs

    # What a subclass (`mesh_steps.MeshSteps`) changes, one decision each.
    def _forward(self, call):
        """The model's forward pass as the steps run it.

        With Keras's `jit_compile=True`, compiled by `torch.compile`, inside
        the uncompiled step (`TorchTrainer._should_torch_compile`): what the
        PyTorch recipe for DDP compiles, while keras_parallel's collectives
        and per-step bookkeeping run as written.
        """
        if getattr(self.model, "jit_compile", False):
            return torch.compile(call)
        return call

    def _check_batch(self, rows):
        if rows < self.world_size:
            raise ValueError(
                f"The global batch has {rows} rows but {self.world_size} "
                "processes train on it, and each needs at least one row. "
                f"Received: batch of {rows} rows, world size "
                f"{self.world_size}; use batch_size >= {self.world_size} "
                "(batch_size is the global batch, split over the processes)."
            )

    def _rows(self, rows):
        """The `StepRows` of this rank in a global batch of `rows` rows."""
        return StepRows(rows, *rows_of.split_rows(rows, self.world_size, self.rank))

    def _counts(self, own):
        """Whether this rank's metric updates of the step `own` count globally."""
        return not own.whole or self.rank == 0

    def _scale(self, own):
        """The factor of this rank's output gradient (module docstring)."""
        used = own.rows * self.world_size if own.whole else own.rows
        return self.world_size * (own.stop - own.start) / used

    def _update_weight(self, own):
        """The weight of this rank's one-value-per-step metric updates.

        `W` times its counted share of the rows, so every step weighs `W` in
        all (`update_weights`).
        """
        counted = own.rows if own.whole else own.stop - own.start
        return self.world_size * counted / own.rows

    def _per_step_weights(self, kind, own):
        if kind == "predict" or self._keras_steps.get(kind, False):
            # Keras's own steps weigh every update by its rows already.
            return contextlib.nullcontext()
        return weighted_per_step_updates(self.model.metrics, self._update_weight(own))

    def _routes(self, kind):
        """Whether the model's forward pass is routed in this kind of step."""
        return kind == "train"

    def _context(self, kind):
        """What is in force while one step runs: the rank's random stream."""
        return self._random_stream if kind == "train" else contextlib.nullcontext()

    def _needs_route(self):
        """Whether routing changes anything: DDP, or a scaled gradient."""
        return self.ddp is not None or self._grad_scale != 1.0

    def own_call(self):
        """The model's own `call`, not `TorchTrainer`'s (this object's `call`)."""
        return self._own_call if self._installed else self.model.call

    def _route_call(self, on):
        self._routing = bool(on) and self._needs_route()

    def get_metrics_result(self):
        """The model's `get_metrics_result`, made global where due."""
        return self.metrics.result()

    def call(self, *args, **kwargs):
        """The model's `call`: through DDP while a train step routes it."""
        if self._routing:
            return self._routed_call(*args, **kwargs)
        return self._own_call(*args, **kwargs)

    def _routed_call(self, *args, **kwargs):
        # The outermost forward of a step, through DDP.
        if self.ddp is not None and torch.is_grad_enabled():
            # A micro-step reduces nothing (`accumulation`).
            with self.accumulation.forward_context(self.ddp):
                outputs = self.ddp(*args, **kwargs)
        else:
            outputs = self._own_call(*args, **kwargs)
        scale = self._grad_scale
        if scale != 1.0:
            for t in [*tree.flatten(outputs), *self._batch_losses()]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, s=scale: g * s)
        return outputs

    def _batch_losses(self):
        """The losses this forward pass added, scaled like the outputs'.

        Each is a mean over this rank's rows. Weight regularizers are not
        among them: DDP's average keeps the whole penalty once.
        """
        return [
            loss
            for layer in self.model._flatten_layers(include_self=True)
            for loss in layer._losses
        ]

    def _gather(self, outputs, rows):
        """Every rank's predictions of its rows, in input order."""
        world = self.world_size
        return tree.map_structure(
            lambda t: rows_of.gathered_rows(t, rows, world), outputs
        )

    # ---------------------------------------------------- non-trainable
    def sync_non_trainable(self):
        """Gives every rank rank 0's non-trainable floating variables.

        As DDP does with buffers: BatchNorm's moving statistics differ by rank.
        """
        self.dirty = False
        broadcast_flat(
            v.value
            for v in self.model.non_trainable_variables
            if torch.is_floating_point(v.value)
        )
