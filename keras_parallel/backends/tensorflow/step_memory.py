"""`Auto`'s prediction on TensorFlow: the state and the gradients, from the plan.

Data parallelism is TensorFlow's one candidate: every replica holds the whole
state and its gradients, which the plan knows exactly. TensorFlow reports no
step's memory ahead (nor a CPU's as it runs), so activations are not
predicted, and the table says so.
"""

import numpy as np

from keras_parallel.backends.base import StepMemory


def step_memory(model, plan):
    """One replica's bytes in a train step of `model` under `plan`.

    Args:
        model: the built `keras.Model` (its optimizer may be unbuilt).
        plan: the candidate's `ShardingPlan`.

    Returns:
        A `StepMemory`: the state, its unbuilt optimizer's and the
        gradients; the bytes the gradients' all-reduce sends.
    """
    trainable = {v.path for v in model.trainable_variables}
    gradients = sum(
        v.bytes_total
        for v in plan.variables
        if v.kind == "model" and v.path in trainable
    )
    replicas = len(plan.devices)
    return StepMemory(
        plan.bytes_per_device(("model", "optimizer", "metric"))
        + unbuilt_optimizer_bytes(model)
        + gradients,
        int(2 * gradients * (replicas - 1) / replicas),
        note="TensorFlow: data parallelism is the one candidate; its need "
        "is the state and the gradients (exact), without the activations, "
        "which TensorFlow does not predict",
    )


def unbuilt_optimizer_bytes(model):
    """The bytes of the state an unbuilt optimizer will make (0 if built).

    `Auto` chooses before `fit` builds the optimizer: a copy of it is built
    for the model's trainable variables, counted, and dropped.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return 0
    copy = type(optimizer).from_config(optimizer.get_config())
    copy.build(model.trainable_variables)
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in copy.variables
    )
