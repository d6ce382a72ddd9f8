"""The PyTorch backend: DDP (DataParallel) or DTensors (ModelParallel) under Keras's trainer.

- `executor`: `TorchExecutor`, the contract's hooks.
- `group`: the process group, started from the environment; failures named.
- `steps`: what each rank does inside one Keras step (slice, DDP, metrics).
- `batches`: cutting a global batch into per-rank rows.
- `step_logs`: when metrics are made global (per step or per epoch).
- `sync_bn`: BatchNormalization over the global batch.
- `model_parallel`: ModelParallel's hooks (`MeshRunner`), DTensor variables.
- `dtensor_layouts`: the torch mesh, placements, placing and gathering.
- `mesh_steps`: the steps under ModelParallel (DTensor forward, gradients).
- `output_constraints`: where layer outputs are laid out under ModelParallel.
- `keras_compat`: every Keras internal this backend reads or patches.
"""
