"""The torch trainer of a distributed model: its class while an entry point runs.

Each of its methods is the installed `RankSteps`' attribute of that name
(`steps.py`), which runs the model's own method for this rank's rows.
"""

from keras_parallel.trainer_class import TrainerMixin, attribute_of


class TorchTrainer(TrainerMixin):
    """Per-rank steps, global metrics and the forward pass through DDP."""

    train_step = attribute_of("_kp_steps", "train_step")
    test_step = attribute_of("_kp_steps", "test_step")
    predict_step = attribute_of("_kp_steps", "predict_step")
    get_metrics_result = attribute_of("_kp_steps", "get_metrics_result")
    _get_metrics_result_or_logs = attribute_of(
        "_kp_steps", "_get_metrics_result_or_logs"
    )
    call = attribute_of("_kp_steps", "call")

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

    _get_regularization_losses = attribute_of("_kp_steps", "_get_regularization_losses")
