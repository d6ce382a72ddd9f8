"""The Keras model as `DistributedDataParallel` wraps it, and Keras's own
DDP (Keras 3.16) kept off it."""

import torch


class DDPModule(torch.nn.Module):
    """The Keras model as DDP sees it: its floating parameters and its `call`.

    The integer seed-generator states are not registered: DDP's broadcast
    would replace each rank's rank-folded seeds (its own dropout masks) with
    rank 0's.
    """

    def __init__(self, model, call):
        super().__init__()
        params = [p for _, p in model.named_parameters() if torch.is_floating_point(p)]
        self.params = torch.nn.ParameterList(params)
        # Not a submodule: that would register the integer parameters too.
        self._call = [call]

    def forward(self, *args, **kwargs):
        return self._call[0](*args, **kwargs)


def keras_ddp_off(model, off=True):
    """Stops Keras 3.16+ from wrapping the model in its own DDP (or undoes it).

    Keras wraps the model unless `model.ddp_model` is not None, then calls
    `model.ddp_model or model`; `False` keeps gradients reduced once (by our
    DDP) and the rank-folded seeds. Set for the model's whole distributed life:
    Keras may make a step function before an entry point's scope is entered.
    """
    if off and hasattr(model, "ddp_model"):
        object.__setattr__(model, "ddp_model", False)
    elif not off and getattr(model, "ddp_model", None) is False:
        object.__setattr__(model, "ddp_model", None)
