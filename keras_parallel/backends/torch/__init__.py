"""The PyTorch backend: DistributedDataParallel under Keras's own torch trainer.

- `executor`: `TorchExecutor`, the contract's hooks.
- `group`: the process group, started from the environment; failures named.
- `steps`: what each rank does inside one Keras step (slice, DDP, metrics).
- `batches`: cutting a global batch into per-rank rows.
- `step_logs`: when metrics are made global (per step or per epoch).
- `sync_bn`: BatchNormalization over the global batch.
- `keras_compat`: every Keras internal this backend reads or patches.
"""
