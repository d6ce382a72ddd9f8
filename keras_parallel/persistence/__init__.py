"""Everything keras_parallel writes to disk and reads back, in one place.

- `atomic`: saved files appear whole or not at all (`model.save`,
  `save_weights`, callbacks' files).
- `backup`: `keras.callbacks.BackupAndRestore`, resumed exactly (random
  state, data order, step).
- `saving`: a `DistributedModel` in Keras's own `.keras` format, its class,
  compile config and distribution with it.
- `checkpoints`: `restore_checkpoint`, a `keras.callbacks.OrbaxCheckpoint`
  read back shard by shard. The reading itself is the executor's
  (`Executor.restore_checkpoint`; on JAX, `backends/jax/orbax.py`), as every
  backend import lives behind its executor.

Persistence sits above the backends (it asks the executor) and below the
binding and the model, which call it.
"""
