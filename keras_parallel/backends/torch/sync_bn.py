"""`sync_batchnorm=True`: Keras BatchNormalization with global batch statistics.

A `BatchNormalization`'s `_moments` sums the rows' sums, squares and count over
the ranks with an autograd-aware all-reduce, as `torch.nn.SyncBatchNorm` does.
"""

import math

import torch
import torch.distributed.nn.functional as dist_fn
from keras import layers

from keras_parallel.keras_seam.replacements import Replacements


def batchnorm_layers(model):
    """Every Keras `BatchNormalization` layer of the model."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, layers.BatchNormalization)
    ]


def global_moments(layer):
    """A `_moments(inputs, mask)` for `layer` over the rows of every rank.

    In float64, so that one pass is as exact as a float32 two-pass variance.
    """
    own = layer._moments

    def moments(inputs, mask):
        if mask is not None:
            return own(inputs, mask)  # Masked statistics: not synchronised.
        axes = list(layer._reduction_axes)
        x = inputs.to(torch.float64)
        count = math.prod(x.shape[a] for a in axes)
        sums = x.sum(dim=axes)
        squares = (x * x).sum(dim=axes)
        counts = torch.tensor([float(count)], dtype=torch.float64, device=x.device)
        packed = dist_fn.all_reduce(torch.cat([sums, squares, counts]))
        n = sums.numel()
        total = packed[-1]
        mean = packed[:n] / total
        variance = torch.clamp(packed[n : 2 * n] / total - mean * mean, min=0.0)
        dtype = inputs.dtype if inputs.dtype != torch.float16 else torch.float32
        return mean.to(dtype), variance.to(dtype)

    return moments


class SyncBatchNorm:
    """Installs `global_moments` on every BatchNorm layer of a model."""

    def __init__(self, model):
        self.model = model
        self._replacements = Replacements()

    def install(self):
        for layer in batchnorm_layers(self.model):
            self._replacements.replace(layer, "_moments", global_moments(layer))

    def uninstall(self):
        self._replacements.restore()
