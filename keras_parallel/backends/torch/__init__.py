"""The PyTorch backend: DDP (DataParallel) or DTensors (ModelParallel) under Keras's trainer.

`executor` holds the contract's hooks, `group` the process group, `steps`
what each rank does inside one Keras step under DDP, and `model_parallel`
the hooks for DTensor variables (ModelParallel, `shard=`); `keras_compat`
lists every Keras internal this backend reads or patches. The module map is
in docs/design.md.
"""
