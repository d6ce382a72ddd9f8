"""The TensorFlow backend: `tf.distribute.MirroredStrategy` under Keras's trainer.

`executor` holds the contract's hooks, `variables` re-creates the variables
under a strategy, `exact` makes uneven batches and the logs exact, and
`workers` runs across processes; `keras_compat` lists every Keras internal
this backend reads or patches. The module map is in docs/design.md.
"""

#: Logical CPU devices per worker: `keras-parallel launch --backend tensorflow
#: --devices-per-process K` sets it, `workers.py` splits the CPU by it.
DEVICES_ENV = "KERAS_PARALLEL_DEVICES_PER_PROCESS"
