"""The input divided between processes: what every backend shares.

Each process prepares only its rows of the same global batches, in the same
order (docs/multihost.md, "The input").
"""
