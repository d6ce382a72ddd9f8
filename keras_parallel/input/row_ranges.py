"""A process's rows of a global batch: one range of rows, or several."""


def as_ranges(own):
    """`[(start, stop), ...]` of what a `rows_of(rows)` returned: one range
    `(start, stop)`, or a list of ranges in increasing order (a TensorFlow
    worker's replicas hold every `W`-th slice of a batch).

    >>> as_ranges((0, 32))
    [(0, 32)]
    >>> as_ranges([(0, 16), (32, 48)])
    [(0, 16), (32, 48)]
    """
    if len(own) == 2 and all(isinstance(bound, int) for bound in own):
        return [tuple(own)]
    return [tuple(r) for r in own]
