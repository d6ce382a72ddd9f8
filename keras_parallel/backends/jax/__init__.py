"""The JAX backend: `jax.sharding` placements under Keras's own JAX trainer.

- `executor`: `JaxExecutor`, the plan applied as `NamedSharding`s.
- `batches`: where a batch's rows go (placed on the mesh, split in the step).
- `processes`, `runtime`: across processes; `orbax`: checkpoints read back.
- `keras_compat`: every Keras internal this backend reads or patches.
"""
