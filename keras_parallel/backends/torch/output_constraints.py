"""Layer outputs under `ModelParallel` on torch: where each is laid out.

While `MeshSteps` are installed, layer outputs and their gradients take their
planned placements, and partial sums are finished where they are made.
`Embedding` and `MultiHeadAttention` get fixes of their own (torch 2.13).
"""

import torch
from keras import layers
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from keras_parallel.backends.torch import dtensor_layouts
from keras_parallel.backends.torch.keras_compat import StatelessScope, tree
from keras_parallel.errors import ShardingError
from keras_parallel.keras_seam.replacements import Replacements


class OutputConstraints:
    """Gives every layer's DTensor outputs their planned placements.

    A layer without an `<layer>/output` key gets `_default_placements`. An
    `Embedding` split along the vocabulary looks up in its table gathered:
    torch 2.13's `MaskPartial` lookup output breaks later ops (a reshape, an
    `Add`). `MultiHeadAttention` gets query, key and value laid out alike:
    keras-nightly's torch attention reuses the query's placements for the
    output (seen: wrong predictions for batches of 11 and 12 rows).
    """

    def __init__(self, steps):
        self.steps = steps
        self._replacements = Replacements()

    def install(self):
        mesh = self.steps.mesh
        wanted = {o.path: o for o in self.steps.plan.outputs}
        model = self.steps.model
        for layer in model._flatten_layers(include_self=False, recursive=True):
            # The layer's `OutputLayout`, or `None` (no key).
            path = (getattr(layer, "path", None) or layer.name) + "/output"
            output = wanted.pop(path, None)
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
        if steps.whole:
            axes = tuple(None if a == steps.plan.batch_axis else a for a in axes)
        return dtensor_layouts.placements(axes, steps.mesh.mesh_dim_names)

    def _default_placements(self, leaf):
        """A layer output without a key: sums finished, batch on its axis only.

        Else DTensor may leave the batch split over the model axis, and the
        next column-split layer computes whole gradients (seen: 256 MB of
        gradient for a 64 MB shard, each step).
        """
        steps = self.steps
        return tuple(
            Replicate()
            if p.is_partial()
            or (p.is_shard(0) and (i != steps.batch_dim or steps.whole))
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
                # Its gradient comes back laid out alike.
                leaf = PlacedGradient.apply(leaf)
            return leaf

        def constrained_call(*args, **kwargs):
            return tree.map_structure(constrain, call(*args, **kwargs))

        return constrained_call


class PlacedGradient(torch.autograd.Function):
    """The identity, whose gradient takes the placements of its input.

    Otherwise torch lays a layer output's gradient out op by op: behind a
    column-split `Dense`, an LSTM's gradient became a `_StridedShard` that
    torch 2.13 cannot view back ("Cannot unflatten tensor with _StridedShard
    placement").
    """

    @staticmethod
    def forward(ctx, x):
        ctx.mesh = x.device_mesh
        ctx.placements = tuple(x.placements)
        # A view (no copy) that carries this backward.
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad


def _gathered_lookup(call, layer, mesh):
    """`layer.call` on its table gathered along the rows (`OutputConstraints`)."""

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
    """`_compute_attention` on q, k, v split alike (`OutputConstraints`)."""

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

    Left to DTensor, a row-split Dense's bias add reduce-scatters them along
    the batch, and the kernel's gradient is computed whole (256 MB for a 64 MB
    shard in the benchmark's MLP); finished at once, as Megatron does, it is
    computed as its shard. Other partial results (`Partial(avg)`) are left to
    DTensor, whose backward cannot make them from a `Partial(sum)`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The mode is off inside this call: `redistribute` does not recurse.
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
