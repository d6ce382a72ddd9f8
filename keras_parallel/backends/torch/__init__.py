"""The PyTorch backend: DDP (DataParallel) or DTensors (ModelParallel) under Keras's trainer.

- `executor`: `TorchExecutor`, the contract's hooks.
- `group`: the process group, started from the environment; failures named.
- `steps`: what each rank does inside one Keras step (slice, DDP, metrics).
- `batches`: cutting a global batch into per-rank rows.
- `step_logs`: when metrics are made global (per step or per epoch).
- `sync_bn`: BatchNormalization over the global batch.
- `model_parallel`: ModelParallel's hooks (`MeshRunner`), DTensor variables.
- `dtensor_layouts`: the torch mesh, placements, placing and gathering.
- `mesh_steps`: the steps under ModelParallel and `shard=` (DTensor forward,
  gradients); `mesh_losses`: their added losses made plain;
  `convolution_kernels`: split kernels gathered where a convolution reads them.
- `output_constraints`: where layer outputs are laid out under ModelParallel.
- `creation`: variables placed as they are made in `distribution.scope()`.
- `accumulation`: gradient accumulation under DDP, one all-reduce per update.
- `keras_compat`: every Keras internal this backend reads or patches.
"""
