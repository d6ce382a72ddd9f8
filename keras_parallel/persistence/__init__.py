"""Everything keras_parallel writes to disk and reads back, in one place.

`atomic` writes files whole or not at all, `backup` makes `BackupAndRestore`
resume exactly, `saving` keeps a `DistributedModel`'s class and distribution in
its `.keras` file, and `checkpoints` reads an `OrbaxCheckpoint` back shard by
shard (the reading is the executor's, as every backend import is). Persistence
sits above the backends and below the binding and the model, which call it.
"""
