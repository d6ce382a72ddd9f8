"""The mean gradient over the ranks where DDP cannot make it.

DDP stalls on a parameter that gets no gradient ("Expected to have finished
reduction in the prior iteration"). `GradientMean` averages at the optimizer
instead: one all-reduce of every gradient (zeros where a rank has none) and
of which ranks had one; a variable no rank had one for stays `None`, as on
one device. The first step runs with it; DDP takes over once all were used.
"""

import torch
import torch.distributed as dist

from keras_parallel.backends.torch.flat_buffers import on_group_device
from keras_parallel.replacements import Replacements


class GradientMean:
    """Averages the optimizer's gradients over the ranks (module docstring).

    Args:
        model: the Keras model (its `optimizer` is read at `install`).
        world_size: the number of ranks.
    """

    def __init__(self, model, world_size):
        self.model = model
        self.world_size = world_size
        self._replacements = Replacements()
        #: After a step: whether every trainable variable had a gradient on
        #: every rank; None before the first.
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
        """`grads` averaged over the ranks; `None` where no rank had one.

        Args:
            grads: this rank's gradients (torch tensors or `None`).
            variables: the Keras variables they belong to.

        Returns:
            A list of the averaged gradients.
        """
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
