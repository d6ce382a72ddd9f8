"""The mean gradient over the ranks where DDP cannot make it.

DDP stalls on a parameter without a gradient ("Expected to have finished
reduction in the prior iteration"); this averages at the optimizer in one
all-reduce, leaving `None` where no rank had a gradient, as on one device.
DDP takes over once every variable had one.
"""

import torch
import torch.distributed as dist

from keras_parallel.backends.torch.flat_buffers import on_group_device
from keras_parallel.keras_seam.replacements import Replacements


class GradientMean:
    """Averages the optimizer's gradients over the ranks (read at `install`)."""

    def __init__(self, model, world_size):
        self.model = model
        self.world_size = world_size
        self._replacements = Replacements()
        #: Whether every variable had a gradient on every rank; None before a step.
        self.all_used = None

    def install(self):
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            return
        apply = optimizer.apply

        def apply_mean_gradients(grads, trainable_variables=None):
            variables = trainable_variables
            if variables is None:
                variables = self.model.trainable_variables
            return apply(self.mean(list(grads), list(variables)), trainable_variables)

        self._replacements.replace(optimizer, "apply", apply_mean_gradients)

    def uninstall(self):
        self._replacements.restore()

    @torch.no_grad()
    def mean(self, grads, variables):
        """`grads` (tensors or `None`) averaged over the ranks; `None` where no
        rank had one."""
        pieces = [
            (g if g is not None else torch.zeros_like(v.value)).reshape(-1)
            for g, v in zip(grads, variables, strict=True)
        ]
        counts = [float(g is not None) for g in grads]
        flat = torch.cat(
            [p.to(torch.float32) for p in pieces]
            + [torch.tensor(counts, dtype=torch.float32, device=pieces[0].device)]
        )
        flat = on_group_device(flat)
        dist.all_reduce(flat)
        had = flat[-len(grads) :].tolist()
        self.all_used = all(n == self.world_size for n in had)
        averaged = []
        offset = 0
        for g, v, n in zip(grads, variables, had, strict=True):
            size = v.value.numel()
            piece = flat[offset : offset + size]
            offset += size
            if n == 0:
                averaged.append(None)
                continue
            dtype = g.dtype if g is not None else v.value.dtype
            averaged.append(
                (piece / self.world_size)
                .reshape(v.value.shape)
                .to(v.value.device, dtype)
            )
        return averaged
