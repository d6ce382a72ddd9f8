"""What each rank does inside Keras's torch steps under `ModelParallel`.

Only the model's `call` runs on DTensors; loss, metrics and trainer stay plain,
as under `steps.RankSteps`. A data group's ranks compute the same rows, and
each output gradient is scaled by `1 / D` (D: the data axis's size).
"""

import contextlib
import warnings

import numpy as np
import torch
from keras import ops
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from keras_parallel.backends.torch import dtensor_layouts
from keras_parallel.backends.torch.convolution_kernels import (
    LocalConvolutions,
    convolution_variables,
    gathered_for_use,
)
from keras_parallel.backends.torch.keras_compat import tree
from keras_parallel.backends.torch.mesh_losses import (
    whole_added_losses,
    whole_regularization_losses,
)
from keras_parallel.backends.torch.output_constraints import (
    FinishedSums,
    OutputConstraints,
)
from keras_parallel.backends.torch.step_metrics import StepRows
from keras_parallel.backends.torch.steps import RankSteps
from keras_parallel.backends.torch.trainer import MeshTrainer
from keras_parallel.keras_seam.replacements import replaced


class MeshSteps(RankSteps):
    """The per-rank steps of `RankSteps`, on a model of DTensor variables.

    Args:
        mesh: the torch `DeviceMesh`.
        plan: the `ShardingPlan` (batch axis, output constraints).
    """

    reduces_gradients = False
    divides_input = False
    trainer = MeshTrainer

    def __init__(self, model, mesh, plan, rank):
        super().__init__(model, None, mesh.size(), rank)
        self.mesh = mesh
        self.plan = plan
        self.batch_dim = plan.axis_names.index(plan.batch_axis)
        coordinate = mesh.get_coordinate()
        self.data_size = int(plan.mesh_shape[self.batch_dim])
        self.data_index = int(coordinate[self.batch_dim])
        #: This rank counts its data group's metrics.
        self.leader = all(
            c == 0 for i, c in enumerate(coordinate) if i != self.batch_dim
        )
        self._stack = None
        self._warned_jit = False
        #: Read gathered where split (`gathered_for_use`).
        self._convolution_variables = convolution_variables(model)
        self._constraints = OutputConstraints(self)

    # -------------------------------------------------------- install
    def install(self):
        if self._installed:
            return
        # Read before `MeshTrainer`'s methods replace the model's.
        self._get_regularization_losses = whole_regularization_losses(self.model)
        super().install()
        self._stack = contextlib.ExitStack()
        # Between steps too: a callback (EarlyStopping) may assign whole values.
        self._stack.enter_context(dtensor_layouts.promotion())
        if self.mesh.device_type == "cpu":
            # torch's CPU flash-attention kernel has no DTensor rule for its
            # backward; the math kernel's ops have.
            self._stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        self._constraints.install()
        self._stack.callback(self._constraints.uninstall)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            self._stack.enter_context(reduced_gradients(optimizer))

    def uninstall(self):
        if not self._installed:
            return
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                stack.close()
        finally:
            super().uninstall()

    # ------------------------------------------------- RankSteps hooks
    def _forward(self, call):
        if getattr(self.model, "jit_compile", False) and not self._warned_jit:
            self._warned_jit = True
            warnings.warn(
                "jit_compile=True is not applied under a torch ModelParallel "
                "distribution: its steps run uncompiled, with the same "
                "results. torch.compile of a forward pass over DTensor "
                "variables fails inside AOTAutograd (RecursionError, torch "
                f"{torch.__version__}). Received: jit_compile=True; compile "
                "with jit_compile=False to silence this warning, or use "
                "DataParallel, which compiles the forward pass.",
                stacklevel=2,
            )
        return call

    def _check_batch(self, rows):
        """Any batch size: a batch the batch axis does not divide is whole."""

    def _rows(self, rows):
        if rows % self.data_size:
            return StepRows(rows, 0, rows, True)
        per_group = rows // self.data_size
        start = self.data_index * per_group
        return StepRows(rows, start, start + per_group, False)

    def _counts(self, own):
        return self.rank == 0 if own.whole else self.leader

    def _scale(self, own):
        return 1.0 if own.whole else 1.0 / self.data_size

    def _routes(self, kind):
        return True

    def _context(self, kind):
        # A data group must draw one dropout mask: no per-rank random stream.
        return contextlib.nullcontext()

    def _needs_route(self):
        # The rows enter `call` as DTensors.
        return True

    def sync_non_trainable(self):
        # DTensor variables are one value on the mesh.
        self.dirty = False

    # --------------------------------------------------------- forward
    def batch_placements(self):
        """The placements of this step's batch: split, or whole."""
        return tuple(
            Shard(0) if i == self.batch_dim and not self.whole else Replicate()
            for i in range(self.mesh.ndim)
        )

    def _routed_call(self, *args, **kwargs):
        placements = self.batch_placements()
        rows = self.step_rows.stop - self.step_rows.start  # This data group's.
        # With a variable split along the batch axis (KerasHub's layouts), a
        # whole batch the mesh does not divide may be sharded unevenly inside
        # the model and fail a reshape ("Cannot flatten unevenly sharded
        # tensor"). Outside training such a batch is padded with its last row,
        # cut from the outputs; padding changes what is computed over the
        # batch (an `add_loss` mean, BatchNorm), so only then.
        pad = 0
        if self.whole and not torch.is_grad_enabled() and self._splits_batch_axis():
            pad = -rows % self.mesh.size()

        def enter(leaf):
            if isinstance(leaf, np.ndarray) and leaf.ndim and leaf.shape[0] == rows:
                # `*_on_batch` hands the step NumPy arrays, which would
                # otherwise enter `call` as this rank's rows only, whole.
                leaf = ops.convert_to_tensor(leaf)
            if (
                isinstance(leaf, torch.Tensor)
                and not isinstance(leaf, DTensor)
                and leaf.ndim
                and leaf.shape[0] == rows
            ):
                if pad:
                    leaf = torch.cat([leaf, leaf[-1:].expand(pad, *leaf.shape[1:])])
                return DTensor.from_local(leaf, self.mesh, placements, run_check=False)
            return leaf

        def leave(leaf):
            if not isinstance(leaf, DTensor):
                return leaf
            wanted = placements if leaf.ndim else (Replicate(),) * self.mesh.ndim
            local = leaf.redistribute(self.mesh, wanted).to_local()
            return local[:rows] if pad and local.ndim else local

        args, kwargs = tree.map_structure(enter, (args, kwargs))
        convolutions = self._convolution_variables
        with (
            FinishedSums(),
            LocalConvolutions(),
            gathered_for_use(convolutions, self.batch_dim),
        ):
            outputs = self._own_call(*args, **kwargs)
        outputs = tree.map_structure(leave, outputs)
        whole_added_losses(self.model)
        # Added losses stay unscaled: each is the global batch's, its gradient
        # counted once; the outputs' loss is a data group's mean, summed.
        scale = self._grad_scale
        if scale != 1.0 and torch.is_grad_enabled():
            for t in tree.flatten(outputs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, s=scale: g * s)
        return outputs

    def _splits_batch_axis(self):
        """Whether the plan splits a variable along the batch axis."""
        batch_axis = self.plan.batch_axis
        return any(batch_axis in v.axes for v in self.plan.variables)

    def _gather(self, outputs, rows):
        # The data groups' rows, in order, are the batch.
        placements = self.batch_placements()

        def gather(t):
            if not isinstance(t, torch.Tensor) or not t.ndim:
                return t
            split = DTensor.from_local(t, self.mesh, placements, run_check=False)
            return split.full_tensor()

        return tree.map_structure(gather, outputs)


@contextlib.contextmanager
def reduced_gradients(optimizer):
    """While in scope, `optimizer.apply` first reduces each gradient.

    Redistributed to its variable's placements once, not by every op of the
    update that reads it.
    """
    apply = optimizer.apply

    def apply_reduced(grads, trainable_variables=None):
        if trainable_variables is not None:
            grads = [
                _reduced(g, v) for g, v in zip(grads, trainable_variables, strict=True)
            ]
        return apply(grads, trainable_variables)

    with replaced({(optimizer, "apply"): apply_reduced}):
        yield


def _reduced(grad, variable):
    value = getattr(variable, "_value", None)
    if not (isinstance(grad, DTensor) and isinstance(value, DTensor)):
        return grad
    # The variable's placements, or its slots' under `shard="optimizer"`.
    wanted = dtensor_layouts.gradient_placements(variable) or value.placements
    if tuple(grad.placements) == tuple(wanted):
        return grad
    return grad.redistribute(value.device_mesh, wanted)
