"""The input divided between processes: what every backend shares.

Each process prepares only its share of the input while training stays one
device's (the same global batches, in the same order): a map-style torch
`DataLoader` loads each process's rows of every global batch
(`rank_loader`), a `PyDataset` of one worker is made round-robin and a
generator drawn by process 0 (each backend moves the batches with its own
collectives), and the rest is read whole by every process. `kinds` names
each input and says, in the line the chief prints, how it is divided.
"""
