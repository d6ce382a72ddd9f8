"""The Keras model as `DistributedDataParallel` wraps it, and Keras's own
DDP (Keras 3.16) kept off it."""

import torch


class DDPModule(torch.nn.Module):
    """The Keras model as DDP sees it: its parameters and its `call`.

    DDP broadcasts rank 0's values of the registered parameters when it is
    made and averages the gradients of the trainable ones. Only floating
    parameters are registered: the integer seed-generator states stay per
    rank (each rank draws its own dropout masks from its rank-folded seeds;
    a broadcast would make them rank 0's).

    Args:
        model: the Keras model (a `torch.nn.Module` on this backend).
        call: the model's own `call`, which `forward` runs.
    """

    def __init__(self, model, call):
        super().__init__()
        params = [p for _, p in model.named_parameters() if torch.is_floating_point(p)]
        self.params = torch.nn.ParameterList(params)
        # Held outside the module tree: registering the model as a submodule
        # would register its integer parameters too.
        self._call = [call]

    def forward(self, *args, **kwargs):
        return self._call[0](*args, **kwargs)


def keras_ddp_off(model, off=True):
    """Stops Keras 3.16+ from wrapping the model in its own DDP (or undoes it).

    With a process group, Keras's torch trainer (3.16+) wraps the whole model
    in `DistributedDataParallel` when it makes a step function, unless
    `model.ddp_model` is not None, and then calls `model.ddp_model or model`.
    `False` keeps the forward pass on the model's own `__call__` (through
    which `RankSteps` routes our DDP): gradients reduced once, not twice; the
    rank-folded seed states not overwritten by DDP's broadcast; the step on
    `loss.backward()`, as in Keras 3.15, which has no `ddp_model`. Set for
    the model's whole distributed life: Keras may make a step function before
    an entry point's scope is entered.
    """
    if off and hasattr(model, "ddp_model"):
        object.__setattr__(model, "ddp_model", False)
    elif not off and getattr(model, "ddp_model", None) is False:
        object.__setattr__(model, "ddp_model", None)
