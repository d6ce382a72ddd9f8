"""The JAX backend: `jax.sharding` placements under Keras's own JAX trainer.

`executor` applies the plan as `NamedSharding`s, `batches` places the batches,
`processes`, `runtime` and `divided_input` run across processes, and
`keras_compat` lists every Keras internal this backend reads or patches.
"""
