"""The torch trainer of a distributed model: its methods while an entry point runs.

Each is the installed `RankSteps`' attribute of that name (`steps.py`), which
runs the model's own method for this rank's rows: put on the model itself
(`keras_seam/overrides.py`), Keras calls it with no frame between.
"""

from keras_parallel.backends.torch.keras_compat import (
    TORCH_COMPILE_CHOICES,
    TRAINER_STEP_NAMES,
)
from keras_parallel.keras_seam.overrides import Overrides


class TorchTrainer(Overrides):
    """Per-rank steps, global metrics and the forward pass through DDP.

    Args:
        steps: the installed `RankSteps`, whose attributes of `STEP_NAMES`
            the model runs.
    """

    #: The model's methods that are the steps' attributes of the same name.
    STEP_NAMES = TRAINER_STEP_NAMES
    names = (*STEP_NAMES, *TORCH_COMPILE_CHOICES)

    def __init__(self, steps):
        for name in self.STEP_NAMES:
            setattr(self, name, getattr(steps, name))

    def _should_torch_compile(self):
        # With `jit_compile=True` Keras would `torch.compile` its whole step
        # function, keras_parallel's collectives and per-step bookkeeping
        # inside it: traced once, they would be replayed without their
        # Python state (DDP's reducer, the rows of the step). The steps
        # compile the model's forward pass instead (`RankSteps._forward`).
        return False

    #: Keras 3.16's name for the same question.
    _use_torch_compile = _should_torch_compile


class MeshTrainer(TorchTrainer):
    """`TorchTrainer` on DTensor variables: weight penalties made whole."""

    STEP_NAMES = (*TorchTrainer.STEP_NAMES, "_get_regularization_losses")
    names = (*STEP_NAMES, *TORCH_COMPILE_CHOICES)
