"""What each rank does inside Keras's torch steps under `ModelParallel`.

The variables are DTensors on the torch mesh (`dtensor_layouts`). Everything
that surrounds the model's forward pass (the loss, the metrics, Keras's
trainer) stays on plain tensors, as under DataParallel (`steps.RankSteps`,
which this extends); only the model's own `call` runs on DTensors:

- Rows: the ranks of one data group (the same index along the batch axis)
  compute the same rows: a global batch of `B` rows over a batch axis of
  size `D` gives each group `B / D` contiguous rows. A batch that `D` does
  not divide (the last of an epoch) is computed whole by every rank, as the
  JAX executor places it replicated: nothing is padded, dropped or counted
  twice, and BatchNorm sees the true batch.
- Forward: the rows enter `call` as a DTensor split along the batch axis
  (`Shard(0)`) and replicated along the others, so every op inside sees the
  global batch (a BatchNorm mean is the global batch's), and leave it as
  this group's rows of the outputs, a plain tensor. `<layer>/output` keys
  redistribute that layer's outputs (DTensor's autograd redistributes their
  gradients back in the backward pass).
- Backward: each rank's output gradient is scaled by `1 / D` (1 for a whole
  batch), so the sum over groups is the gradient of the global mean loss.
  Before the optimizer runs, every gradient is redistributed to its
  variable's placements: the partial sums over the batch axis (and over a
  model axis, for a replicated variable used with split ones) are
  all-reduced there. Optimizer slots are DTensors with their variable's
  placements, so the update runs shard by shard.
- Added losses: `add_loss` (an activity regularizer too) runs inside
  `call` on the DTensor of the global batch, so its DTensor scalar is the
  global batch's value; it is made whole and plain (`full_tensor()`) once
  the forward pass has run. A weight regularizer reads its variable's
  whole value, and its loss is plain. Keras adds both to the plain loss;
  each is replicated, so DTensor's autograd counts its gradient once, as
  one device does, and it is not scaled by `1 / D` as the outputs'
  gradients are.
- Metrics: one rank per data group (the one at index 0 of every other axis)
  counts its rows; the base class sums the counts over ranks.
- Predict: the groups' rows are gathered in input order on every rank.
"""

import contextlib

import numpy as np
import torch
from keras import ops
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from keras_parallel.backends.torch import dtensor_layouts
from keras_parallel.backends.torch.keras_compat import StatelessScope, tree
from keras_parallel.backends.torch.output_constraints import (
    FinishedSums,
    OutputConstraints,
)
from keras_parallel.backends.torch.steps import RankSteps
from keras_parallel.replacements import replaced


class MeshSteps(RankSteps):
    """The per-rank steps of `RankSteps`, on a model of DTensor variables.

    Args:
        model: the Keras model, its variables placed by `dtensor_layouts`.
        mesh: the torch `DeviceMesh`.
        plan: the `ShardingPlan` (batch axis, output constraints).
        rank: this process's rank.
    """

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
        self._local_rows = None
        self._stack = None
        #: Read gathered in the forward pass where split (`gathered_for_use`).
        self._convolution_variables = convolution_variables(model)
        self._constraints = OutputConstraints(self)

    # -------------------------------------------------------- install
    def install(self):
        if self._installed:
            return
        super().install()
        self._stack = contextlib.ExitStack()
        # Between steps too: a callback may assign whole values (EarlyStopping
        # restoring weights) to split variables.
        self._stack.enter_context(dtensor_layouts.promotion())
        if self.mesh.device_type == "cpu":
            # torch's CPU flash-attention kernel (which Keras's
            # `dot_product_attention` reaches) has no DTensor rule for its
            # backward; the math kernel is made of ops that have one.
            self._stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        self._constraints.install()
        self._stack.callback(self._constraints.uninstall)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            self._stack.enter_context(reduced_gradients(optimizer))
        self._stack.enter_context(whole_regularization_losses(self.model))

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
    def _check_batch(self, rows):
        """Any batch size: a batch the batch axis does not divide is whole."""

    def _rows(self, rows):
        if rows % self.data_size:
            self._local_rows = rows
            return 0, rows, True
        per_group = rows // self.data_size
        start = self.data_index * per_group
        self._local_rows = per_group
        return start, start + per_group, False

    def _counts(self, whole):
        return self.rank == 0 if whole else self.leader

    def _scale(self, rows, start, stop, whole):
        return 1.0 if whole else 1.0 / self.data_size

    def _routes(self, kind):
        return True

    def _context(self, kind):
        # Every rank of a data group must draw the same dropout mask (the
        # layer draws it in the global shape): no per-rank random stream.
        return contextlib.nullcontext()

    def _needs_route(self):
        # The rows enter `call` as DTensors: every routed step goes through.
        return True

    def sync_non_trainable(self):
        # DTensor variables are one value on the mesh: nothing to agree on.
        self.dirty = False

    # --------------------------------------------------------- forward
    def batch_placements(self):
        """The placements of this step's batch: split, or whole."""
        return tuple(
            Shard(0) if i == self.batch_dim and not self._whole else Replicate()
            for i in range(self.mesh.ndim)
        )

    def _routed_call(self, *args, **kwargs):
        placements = self.batch_placements()
        rows = self._local_rows
        # A whole batch that the mesh does not divide can make torch shard
        # it unevenly inside the model, where a reshape then fails ("Cannot
        # flatten unevenly sharded tensor"), when a variable is split along
        # the batch axis (KerasHub's layouts): the batch, replicated along
        # that axis, meets the split weight. In evaluation and prediction
        # rows are independent: such a batch is then padded to a multiple
        # of the mesh size (its last row repeated) and the padding cut from
        # the outputs. Only then: with no variable split along the batch
        # axis nothing splits the replicated batch along it, and padding
        # would change what is computed over the batch (an `add_loss` mean,
        # an activity regularizer's sum). Training keeps the true batch
        # (BatchNorm).
        pad = 0
        if self._whole and not torch.is_grad_enabled() and self._splits_batch_axis():
            pad = -rows % self.mesh.size()

        def enter(leaf):
            if isinstance(leaf, np.ndarray) and leaf.ndim and leaf.shape[0] == rows:
                # `train_on_batch` (and `test_on_batch`, `predict_on_batch`)
                # hand Keras's step the user's NumPy arrays, which a
                # functional model converts inside `call`: left as they are,
                # they would enter as this rank's rows only, whole.
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
        with FinishedSums(), gathered_for_use(convolutions, self.batch_dim):
            outputs = self._own_call(*args, **kwargs)
        outputs = tree.map_structure(leave, outputs)
        _whole_added_losses(self.model)
        # The added losses are left unscaled: each is the global batch's,
        # replicated (`_whole_added_losses`), and DTensor's autograd counts
        # its gradient once; the outputs' loss is a mean over this data
        # group's rows, whose gradient the groups sum.
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
        # Each data group holds its rows; together, in order, they are the
        # batch (the batch axis divides it, else it was computed whole).
        placements = self.batch_placements()

        def gather(t):
            if not isinstance(t, torch.Tensor) or not t.ndim:
                return t
            split = DTensor.from_local(t, self.mesh, placements, run_check=False)
            return split.full_tensor()

        return tree.map_structure(gather, outputs)


#: The Keras layers whose op reads a kernel through DTensor's convolution
#: rule (`gathered_for_use`).
CONVOLUTIONS = (
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "DepthwiseConv1D",
    "DepthwiseConv2D",
    "SeparableConv1D",
    "SeparableConv2D",
)


def convolution_variables(model):
    """The trainable variables of the model's convolution layers."""
    import keras

    kinds = tuple(getattr(keras.layers, name) for name in CONVOLUTIONS)
    found = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, kinds):
            for variable in layer.trainable_variables:
                found[id(variable)] = variable
    return list(found.values())


@contextlib.contextmanager
def gathered_for_use(variables, batch_dim):
    """While in scope, these variables, if split over the batch axis, are read
    gathered along it.

    DTensor's rules for a matmul, an einsum or an embedding read a split
    weight (each chooses between gathering it and splitting its output,
    whichever moves less), but its convolution rule assumes a replicated
    weight and computes each rank's output from its shard of the kernel
    (seen under `shard="full"`: the guide's convnet failed with "shape
    '[16, 12, 12, 24]' is invalid for input of size 13824"). So, for the
    forward pass, each convolution's split variable holds its gathered
    DTensor (a redistribution of its parameter, still split along any other
    axis), which the convolution reads as a replicated weight; its gradient
    flows back through the redistribution and is reduce-scattered to the
    parameter's shard. The parameter is back in place before the backward
    pass reads `variable.value.grad`. (Gathering every split variable so
    instead made the 100 M-parameter MLP of
    `benchmarks/bench_torch_sharding.py` 4.4 times slower and 38 % larger
    than DTensor's own choice.)

    Args:
        variables: the variables read by convolutions
            (`convolution_variables`).
        batch_dim: the index of the batch axis in the mesh.
    """
    swapped = []
    try:
        for variable in variables:
            value = variable._value
            if not isinstance(value, DTensor):
                continue
            placements = tuple(value.placements)
            if not isinstance(placements[batch_dim], Shard):
                continue
            gathered = (
                placements[:batch_dim] + (Replicate(),) + placements[batch_dim + 1 :]
            )
            swapped.append((variable, value))
            variable._value = value.redistribute(value.device_mesh, gathered)
        yield
    finally:
        for variable, value in reversed(swapped):
            variable._value = value


def whole(value):
    """A DTensor made whole and plain (a collective); anything else as is.

    Its gradient keeps DTensor's meaning: a replicated scalar's gradient is
    counted once, not once per rank.
    """
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def _whole_added_losses(model):
    """Makes the losses the forward pass added whole and plain (in place).

    `add_loss` inside `call` (an activity regularizer too) computes on the
    DTensor of the global batch: its value is already the global batch's.
    Keras adds it to the plain loss of this rank's rows, which torch refuses
    for a DTensor (an `AssertionError` in DTensor's dispatch). Every rank
    runs the same layers, so the collectives come in the same order.

    Args:
        model: the Keras model whose forward pass just ran.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        losses = layer._losses
        if any(isinstance(loss, DTensor) for loss in losses):
            losses[:] = [whole(loss) for loss in losses]


@contextlib.contextmanager
def whole_regularization_losses(model):
    """While in scope, `model`'s weight-regularization losses are plain.

    Keras computes them from the variables whenever it reads `model.losses`
    (the loss of every train and test step). On the DTensor variables
    themselves a regularizer may fail (`L1L2` adds its DTensor terms in
    place to a plain zero: an `AssertionError` in DTensor's dispatch), and
    what it returns is a DTensor that Keras cannot add to the plain loss.
    So each regularizer reads its variable's whole value (gathered, a
    collective; a replicated variable costs nothing), through Keras's own
    `StatelessScope`: the penalty is one device's, computed in the same
    order, and it is plain. Its gradient reaches each shard once: the
    backward pass of a gather (or of `to_local` of a replicated DTensor)
    hands each process its own part of one replicated gradient, which is
    not summed over the ranks, unlike the partial sums of the outputs'
    gradients.

    Args:
        model: the Keras model.
    """
    regularization_losses = model._get_regularization_losses

    def whole_losses():
        mapping = [
            (variable, whole(variable.value))
            for variable in model.trainable_weights
            if variable.regularizer is not None
        ]
        if not any(isinstance(v.value, DTensor) for v, _ in mapping):
            return regularization_losses()
        with StatelessScope(state_mapping=mapping):
            return [whole(loss) for loss in regularization_losses()]

    with replaced({(model, "_get_regularization_losses"): whole_losses}):
        yield


@contextlib.contextmanager
def reduced_gradients(optimizer):
    """While in scope, `optimizer.apply` first reduces each gradient.

    A gradient leaves the backward pass with the placements the ops gave it
    (`Partial` sums over the batch axis, for one); it is redistributed to
    its variable's placements before Keras's update reads it, once, rather
    than by every op of the update that reads it.

    Args:
        optimizer: the model's Keras optimizer.
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
    # Where `place` sends the gradient: the variable's placements, or
    # (`shard="optimizer"`) its optimizer slots', whose update then runs on
    # shards and whose new value DTensor gathers into the whole variable.
    wanted = dtensor_layouts.gradient_placements(variable) or value.placements
    if tuple(grad.placements) == tuple(wanted):
        return grad
    return grad.redistribute(value.device_mesh, wanted)
