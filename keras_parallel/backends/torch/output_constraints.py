"""Layer outputs under `ModelParallel` on torch: where each is laid out.

While `MeshSteps` are installed, every layer's DTensor outputs take their
planned placements (`OutputConstraints`), and their gradients the same
(`PlacedGradient`); inside the layers, partial sums are finished where they
are made (`FinishedSums`). `Embedding` and `MultiHeadAttention` get fixes of
their own (torch 2.13).
"""

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from keras_parallel.backends.torch import dtensor_layouts
from keras_parallel.backends.torch.keras_compat import tree
from keras_parallel.errors import ShardingError
from keras_parallel.replacements import Replacements


class OutputConstraints:
    """Redistributes the outputs of the layers `<layer>/output` keys name.

    While installed, every layer's `call` is wrapped (an instance
    attribute) so that its DTensor outputs take the planned placements. In a
    step whose batch is computed whole, the batch axis is dropped from the
    constraint: the batch is not split there. A layer without a key gets
    `_default_placements`: partial sums finished, the batch split along the
    batch axis only.

    Every `Embedding` whose table is split along its rows (the vocabulary)
    looks its rows up in the table gathered along them, for the call only
    (the gradient is reduce-scattered back to the shards): torch (2.13)
    gives such a lookup a `MaskPartial` output, which it cannot carry
    through later ops (a reshape in `EinsumDense`, a residual `Add`, a batch
    it split itself: an `AssertionError` or an `IndexError` on the mask's
    shape).

    Every `MultiHeadAttention` computes its attention on query, key and
    value laid out alike, split along the batch and the heads only (other
    splits and partial sums made whole first): keras-nightly's torch
    `dot_product_attention` computes on each process's local parts and
    reuses the query's placements for the output, which is wrong for a key
    or value laid out otherwise (seen: wrong predictions for batches of 11
    and 12 rows, right ones for 64).

    Args:
        steps: the `MeshSteps` (mesh, plan, whether the batch is whole).
    """

    def __init__(self, steps):
        self.steps = steps
        self._replacements = Replacements()

    def _layers(self):
        """Every layer, with its `OutputLayout` or `None` (no key)."""
        wanted = {o.path: o for o in self.steps.plan.outputs}
        model = self.steps.model
        for layer in model._flatten_layers(include_self=False, recursive=True):
            path = (getattr(layer, "path", None) or layer.name) + "/output"
            yield layer, wanted.pop(path, None)

    def install(self):
        from keras import layers

        mesh = self.steps.mesh
        for layer, output in self._layers():
            call = layer.call
            if isinstance(layer, layers.Embedding):
                call = _gathered_lookup(call, layer, mesh)
            self._replacements.replace(layer, "call", self._constrained(call, output))
            if isinstance(layer, layers.MultiHeadAttention):
                self._replacements.replace(
                    layer,
                    "_compute_attention",
                    _aligned_attention(layer._compute_attention, mesh),
                )

    def uninstall(self):
        self._replacements.restore()

    def _placements(self, leaf, output):
        steps = self.steps
        if output is None:
            return self._default_placements(leaf)
        if leaf.ndim != len(output.axes):
            raise ShardingError(
                f"The layout of output key {output.key!r} has rank "
                f"{len(output.axes)}, but the output of {output.path!r} has "
                f"rank {leaf.ndim}. Received: axes={output.axes}, output "
                f"shape={tuple(leaf.shape)}; give one axis (or None) per "
                "output dimension."
            )
        axes = output.axes
        if steps._whole:
            axes = tuple(None if a == steps.plan.batch_axis else a for a in axes)
        return dtensor_layouts.placements(axes, steps.mesh.mesh_dim_names)

    def _default_placements(self, leaf):
        """A layer output without a key: sums finished, batch on its axis.

        Left to itself, DTensor may finish a row-split layer's partial sums
        by a reduce-scatter along the batch (cheaper than an all-reduce) and
        leave the batch split over the model axis; the next column-split
        layer then gathers its whole kernel and computes whole gradients
        (seen: a 256 MB gradient of a 64 MB shard, each step). At a layer's
        output, as under JAX's plan, partial sums are all-reduced and the
        batch (dimension 0) is split along the batch axis only.
        """
        steps = self.steps
        return tuple(
            Replicate()
            if p.is_partial()
            or (p.is_shard(0) and (i != steps.batch_dim or steps._whole))
            else p
            for i, p in enumerate(leaf.placements)
        )

    def _constrained(self, call, output):
        def constrain(leaf):
            if not isinstance(leaf, DTensor):
                return leaf
            wanted = self._placements(leaf, output)
            if tuple(leaf.placements) != wanted:
                leaf = leaf.redistribute(self.steps.mesh, wanted)
            if leaf.requires_grad:
                # Its gradient comes back laid out alike (`PlacedGradient`).
                leaf = PlacedGradient.apply(leaf)
            return leaf

        def constrained_call(*args, **kwargs):
            return tree.map_structure(constrain, call(*args, **kwargs))

        return constrained_call


class PlacedGradient(torch.autograd.Function):
    """The identity, whose gradient takes the placements of its input.

    Applied to every layer output (`OutputConstraints`): the backward pass's
    twin of the output's own placements. The gradient reaching a layer
    output is otherwise laid out as the ops after it left it, which torch
    chooses op by op in the backward pass, where no `FinishedSums` runs:
    behind a column-split `Dense`, an LSTM's output gradient came back as
    partial sums over the model axis, which torch finished by splitting the
    batch over the model axis too; inside the LSTM that became a
    `_StridedShard` of its time-major `[time * batch, features]` matmul
    input, which torch 2.13 cannot view back as `[time, batch, features]`
    ("Cannot unflatten tensor with _StridedShard placement"). Given the
    output's placements (partial sums finished, the batch split along the
    batch axis only), each layer's backward starts from the layout its
    forward pass had. The values are the same (a sum finished earlier).
    """

    @staticmethod
    def forward(ctx, x):
        ctx.mesh = x.device_mesh
        ctx.placements = tuple(x.placements)
        # A new tensor (a view, no copy) that carries this backward.
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad


def _gathered_lookup(call, layer, mesh):
    """`layer.call` on its table gathered along the rows (class docstring)."""
    from keras_parallel.backends.torch.keras_compat import StatelessScope

    def lookup(*args, **kwargs):
        variable = layer.embeddings
        table = variable.value
        if not isinstance(table, DTensor) or not any(
            p.is_shard(0) for p in table.placements
        ):
            return call(*args, **kwargs)
        whole_rows = tuple(
            Replicate() if p.is_shard(0) else p for p in table.placements
        )
        table = table.redistribute(mesh, whole_rows)
        with StatelessScope(state_mapping=[(variable, table)]):
            return call(*args, **kwargs)

    return lookup


def _aligned_attention(compute, mesh):
    """`_compute_attention` on q, k, v split alike (class docstring)."""

    def aligned(query, key, value, *args, **kwargs):
        if isinstance(query, DTensor):
            # [batch, positions, heads, head size]: batch and heads only.
            wanted = tuple(
                p if p.is_shard(0) or p.is_shard(2) else Replicate()
                for p in query.placements
            )
            query, key, value = (
                t.redistribute(mesh, wanted) if isinstance(t, DTensor) else t
                for t in (query, key, value)
            )
        return compute(query, key, value, *args, **kwargs)

    return aligned


#: The contractions whose partial sums `FinishedSums` finishes at once.
CONTRACTIONS = frozenset(
    (
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
        torch.tensordot,
        torch.nn.functional.linear,
    )
)


class FinishedSums(TorchFunctionMode):
    """While active, a contraction's partial sums are all-reduced at once.

    A contraction over a split dimension (the matmul of a row-split kernel)
    gives partial sums. Left to itself, DTensor finishes them where the next
    op needs it, by the cheapest collective for that op: for a Dense layer's
    bias add, a reduce-scatter along the batch. The gradient then comes back
    split along the batch, and DTensor computes the kernel's gradient as
    whole partial sums, reduce-scattered to the shard afterwards: a 256 MB
    gradient for a 64 MB shard, each step (seen in the benchmark's MLP).
    Finished at once (an all-reduce of the activations, as a Megatron
    row-parallel layer does), the gradient comes back replicated and the
    kernel's gradient is computed as its shard. The values are the same
    either way (up to the order of float additions). Only contractions (`CONTRACTIONS`): other partial results (a
    mean over the split batch, `Partial(avg)`) are left to DTensor, whose
    backward pass cannot turn a gradient's `Partial(sum)` into them.

    Active around the model's `call` only: the loss, the backward pass and
    the optimizer's update run after it has exited.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The mode is not active inside this call: `redistribute` below
        # does not come back here.
        result = func(*args, **(kwargs or {}))
        if (
            func in CONTRACTIONS
            and isinstance(result, DTensor)
            and any(p.is_partial() for p in result.placements)
        ):
            finished = tuple(
                Replicate() if p.is_partial() else p for p in result.placements
            )
            result = result.redistribute(result.device_mesh, finished)
        return result
