"""The torch trainer of a distributed model: its class while an entry point runs.

Each method hands Keras's call to the model's installed `RankSteps`
(`steps.py`), which runs the model's own method for this rank's rows.
"""

from keras_parallel.trainer_class import TrainerMixin

#: The methods `TorchTrainer` defines, set aside on the model while it runs.
NAMES = (
    "train_step",
    "test_step",
    "predict_step",
    "get_metrics_result",
    "_get_metrics_result_or_logs",
    "call",
)


class TorchTrainer(TrainerMixin):
    """Per-rank steps, global metrics and the forward pass through DDP."""

    def train_step(self, data):
        return self._kp_steps.steps["train"](data)

    def test_step(self, data):
        return self._kp_steps.steps["test"](data)

    def predict_step(self, data):
        return self._kp_steps.steps["predict"](data)

    def get_metrics_result(self):
        return self._kp_steps.metrics_result()

    def _get_metrics_result_or_logs(self, logs):
        return self._kp_steps.epoch_logs(logs)

    def call(self, *args, **kwargs):
        return self._kp_steps.forward(*args, **kwargs)
