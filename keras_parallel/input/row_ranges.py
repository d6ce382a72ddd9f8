"""A process's rows of a global batch: one range of rows, or several."""


def as_ranges(own):
    """`[(start, stop), ...]` from what `rows_of(rows)` returned: one range, or
    a list of ranges in increasing order (a TensorFlow worker's replicas hold
    every `W`-th slice of a batch)."""
    if len(own) == 2 and all(isinstance(bound, int) for bound in own):
        return [tuple(own)]
    return [tuple(r) for r in own]
