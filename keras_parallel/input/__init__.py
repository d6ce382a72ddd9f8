"""The input divided between processes: what every backend shares.

Each process prepares only its share of the input while training stays one
device's (the same global batches, in the same order): `kinds` names each input
and says how it is divided, `rank_loader` and `tf_data_rows` cut a torch
`DataLoader` and a `tf.data` pipeline to one process's rows (docs/multihost.md,
"The input").
"""
