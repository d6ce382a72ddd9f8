"""The TensorFlow backend: `tf.distribute.MirroredStrategy` under Keras's trainer.

`executor` holds the hooks, `variables` moves variables under a strategy,
`exact` makes uneven batches and the logs exact, `workers` runs across
processes, and `keras_compat` lists the Keras internals read or patched.
"""

#: Logical CPU devices per worker (`keras-parallel launch --devices-per-process`).
DEVICES_ENV = "KERAS_PARALLEL_DEVICES_PER_PROCESS"
