"""The TensorFlow backend: `tf.distribute.MirroredStrategy` under Keras's trainer.

- `executor`: `TensorFlowExecutor`, the contract's hooks.
- `devices`: local devices and logical CPU devices (`split_cpu`).
- `variables`: re-creating variables under a strategy, values kept.
- `exact`: exact per-replica loss weighting and global logs; `patched`.
- `strategies`: mirrored strategies whose replicas know their batch share.
- `element_spec_build`: the model built with no batch drawn.
- `summed_gradients`: clipping and accumulation on the summed gradient.
- `collective_keys`: collectives keyed when traced inside control flow.
- `workers`: across processes, the `MultiWorkerMirroredStrategy` that
  `TF_CONFIG` asks for, and what the workers share.
- `saving_references`: Keras's saving inside a strategy, made collective-free.
- `keras_compat`: every Keras internal this backend reads or patches.
"""

#: Logical CPU devices per worker: `keras-parallel launch --backend tensorflow
#: --devices-per-process K` sets it, `workers.py` splits the CPU by it.
DEVICES_ENV = "KERAS_PARALLEL_DEVICES_PER_PROCESS"
