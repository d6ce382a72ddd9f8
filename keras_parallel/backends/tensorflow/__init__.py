"""The TensorFlow backend: `tf.distribute.MirroredStrategy` under Keras's trainer.

- `executor`: `TensorFlowExecutor`, the contract's hooks.
- `devices`: local devices and logical CPU devices (`split_cpu`).
- `variables`: re-creating variables under a strategy, values kept.
- `exact`: exact per-replica loss weighting and global logs.
- `workers`: across processes, the `MultiWorkerMirroredStrategy` that
  `TF_CONFIG` asks for, and what the workers share.
- `keras_compat`: every Keras internal this backend reads or patches.
"""
