"""The JAX backend: `jax.sharding` placements under Keras's own JAX trainer.

- `executor`: `JaxExecutor`, the plan applied as `NamedSharding`s.
- `keras_compat`: every Keras internal this backend reads or patches.
"""
