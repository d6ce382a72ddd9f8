"""Keras's gradient accumulation under DDP: one gradient all-reduce per update.

A micro-step's forward runs under DDP's `no_sync()` (DDP decides in its
forward whether the backward reduces), so the accumulators hold each rank's
own sums; the update step averages them over the ranks in one all-reduce.
That is exact: each rank's output gradient is scaled so that the ranks' mean
is the global gradient (`steps.RankSteps._scale`). DTensor variables need none.
"""

import contextlib

import torch

from keras_parallel.backends.torch.flat_buffers import mean_flat
from keras_parallel.replacements import Replacements


def accumulation_steps(optimizer):
    """The optimizer's `gradient_accumulation_steps`, or 0 without it.

    Args:
        optimizer: a Keras optimizer, or `None`.

    Returns:
        An int: `k >= 2` when Keras accumulates gradients over `k` steps.
    """
    return int(getattr(optimizer, "gradient_accumulation_steps", None) or 0)


def is_micro_step(optimizer):
    """Whether the coming `optimizer.apply` only accumulates (no update).

    Keras updates on the step whose `_iterations + 1` is a multiple of `k`
    (`_iterations` counts every step, micro-steps included).

    Args:
        optimizer: a Keras optimizer, or `None`.

    Returns:
        True on the first `k - 1` steps of every `k`; False without
        accumulation.
    """
    steps = accumulation_steps(optimizer)
    if not steps:
        return False
    return (int(optimizer._iterations.value) + 1) % steps != 0


class AccumulatedGradients:
    """Skips DDP's all-reduce on micro-steps; averages accumulators on updates.

    Installed by `RankSteps` with the per-rank steps, only when the model's
    optimizer accumulates gradients and DDP reduces them.

    Args:
        model: the Keras model (its `optimizer` is read at `install`).
        world_size: the number of ranks.
    """

    def __init__(self, model, world_size):
        self.model = model
        self.world_size = world_size
        self._replacements = Replacements()
        #: Optimizer updates whose accumulators were all-reduced.
        self.reduced_updates = 0

    def install(self):
        """Replaces the optimizer's `apply` (on the object) while installed."""
        optimizer = getattr(self.model, "optimizer", None)
        if not accumulation_steps(optimizer):
            return
        apply = optimizer.apply

        def apply_with_global_accumulators(grads, trainable_variables=None):
            if not is_micro_step(optimizer):
                self.average_accumulators(optimizer)
            return apply(grads, trainable_variables)

        self._replacements.replace(optimizer, "apply", apply_with_global_accumulators)

    def uninstall(self):
        self._replacements.restore()

    def forward_context(self, ddp):
        """What the DDP forward runs under: `no_sync()` on a micro-step.

        Args:
            ddp: the `DistributedDataParallel` wrapper.

        Returns:
            A context manager.
        """
        if is_micro_step(getattr(self.model, "optimizer", None)):
            return ddp.no_sync()
        return contextlib.nullcontext()

    @torch.no_grad()
    def average_accumulators(self, optimizer):
        """Makes each accumulator the mean over ranks of its local sums.

        One all-reduce of all of them, flattened. Before the optimizer's
        first `build` there are none.

        Args:
            optimizer: the Keras optimizer.
        """
        accumulators = [
            v.value
            for v in getattr(optimizer, "_accumulated_gradients", None) or ()
            if v is not None
        ]
        if not accumulators or self.world_size == 1:
            return
        mean_flat(accumulators, self.world_size)
        self.reduced_updates += 1
