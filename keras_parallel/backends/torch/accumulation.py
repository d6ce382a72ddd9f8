"""Keras's gradient accumulation under DDP: one gradient all-reduce per update.

DDP decides in its forward whether the backward reduces, so a micro-step's
forward runs under `no_sync()` and the update step averages the accumulated
sums in one all-reduce (exact: `steps.RankSteps._scale`).
"""

import contextlib

import torch

from keras_parallel.backends.torch.flat_buffers import mean_flat
from keras_parallel.keras_seam.replacements import Replacements


def accumulation_steps(optimizer):
    """`optimizer`'s `gradient_accumulation_steps` (`k >= 2`), or 0 without it."""
    return int(getattr(optimizer, "gradient_accumulation_steps", None) or 0)


def is_micro_step(optimizer):
    """Whether the coming `optimizer.apply` only accumulates (no update).

    Keras updates when `_iterations + 1` (micro-steps included) is a multiple
    of `k`.
    """
    steps = accumulation_steps(optimizer)
    if not steps:
        return False
    return (int(optimizer._iterations.value) + 1) % steps != 0


class AccumulatedGradients:
    """Skips DDP's all-reduce on micro-steps; averages accumulators on updates.

    Args:
        model: the Keras model (its `optimizer` is read at `install`).
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
        """What the DDP forward runs under: `no_sync()` on a micro-step."""
        if is_micro_step(getattr(self.model, "optimizer", None)):
            return ddp.no_sync()
        return contextlib.nullcontext()

    @torch.no_grad()
    def average_accumulators(self, optimizer):
        """Makes each accumulator its mean over the ranks, in one all-reduce.

        There are none before the optimizer's first `build`.
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
