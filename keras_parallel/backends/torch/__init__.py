"""The PyTorch backend: DDP (DataParallel) or DTensors (ModelParallel).

`executor` holds the contract's hooks, `steps` a rank's work in one step,
`model_parallel` the DTensor hooks, and `keras_compat` every Keras internal
read or patched. The module map is in docs/design.md.
"""
