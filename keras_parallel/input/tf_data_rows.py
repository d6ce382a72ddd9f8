"""A `tf.data.Dataset` read as one process's rows of its global batches.

For a pipeline that ends in row-wise maps and a `batch`, `rows_dataset` adds a
filter before the maps that keeps this process's rows, dividing their work; any
other shape is read whole. `TF_DATA_INTERNALS` lists the tf.data internals read.
"""

from keras_parallel.input import row_ranges

#: tf.data's private dataset classes and attributes read here.
TF_DATA_INTERNALS = {
    "_BatchDataset": ("_input_dataset", "_batch_size", "_drop_remainder"),
    "_ParallelBatchDataset": ("_input_dataset", "_batch_size", "_drop_remainder"),
    "_MapDataset": ("_input_dataset", "_map_func"),
    "_ParallelMapDataset": (
        "_input_dataset",
        "_map_func",
        "_num_parallel_calls",
        "_deterministic",
    ),
    "_PrefetchDataset": ("_input_dataset",),
    "_OptionsDataset": ("_input_dataset",),
}
#: The attribute of a map's `_map_func` that holds the user's function.
TF_DATA_MAP_FUNCTION = "_func"
_PASSED_THROUGH = ("_PrefetchDataset", "_OptionsDataset")
_BATCHES = ("_BatchDataset", "_ParallelBatchDataset")
_MAPS = ("_MapDataset", "_ParallelMapDataset")


class RowsDataset:
    """One process's rows of a pipeline's global batches.

    Attributes:
        dataset: a `tf.data.Dataset` of `(global rows, part)`: the size of
            each global batch and this process's rows of it.
        maps: how many of the pipeline's maps run on this process's rows
            only.
    """

    def __init__(self, dataset, maps):
        self.dataset = dataset
        self.maps = maps


def rows_dataset(dataset, rows_of):
    """The pipeline rebuilt to make only this process's rows, or None.

    Args:
        dataset: the user's `tf.data.Dataset` of global batches.
        rows_of: `rows_of(rows)` is this process's rows of a global batch of
            `rows` rows: `(start, stop)`, or a list of such ranges in order.

    Returns:
        A `RowsDataset`, or None where no row-wise maps sit right under the
        batch or the pipeline cannot be rebuilt.
    """
    import tensorflow as tf

    found = _batch_and_maps(dataset)
    specs = tf.nest.flatten(dataset.element_spec)
    if found is None or not all(isinstance(s, tf.TensorSpec) for s in specs):
        return None  # Sparse and ragged rows are read whole, as Keras reads them.
    batch, maps = found
    size = int(batch._batch_size)
    drop = bool(batch._drop_remainder)
    source = maps[-1]._input_dataset
    count = int(source.cardinality())
    if count == tf.data.UNKNOWN_CARDINALITY:
        return None  # Where the last, partial, batch falls is unknown.
    full = count // size if count >= 0 else -1  # -1: every batch full.
    last = count % size if count >= 0 and not drop else 0
    full_ranges, last_ranges = _own(rows_of, size), _own(rows_of, last or size)

    def batch_of(index):
        return index // size

    def rows_of_batch(b):
        if full < 0:
            return tf.constant(size, tf.int64)
        return tf.where(b < full, tf.constant(size, tf.int64), last)

    def within(j, ranges):
        return tf.reduce_any([(j >= a) & (j < b) for a, b in ranges])

    def kept(index, _):
        b, j = batch_of(index), index % size
        in_full = tf.constant(True) if full < 0 else b < full
        keep = in_full & within(j, full_ranges)
        if last:
            keep |= ~in_full & within(j, last_ranges)
        elif full >= 0:
            keep &= in_full  # `drop_remainder`: the partial batch's rows.
        return keep

    def share(b):
        full_share = tf.constant(_count(full_ranges), tf.int64)
        if full < 0:
            return full_share
        return tf.where(b < full, full_share, _count(last_ranges))

    own = source.enumerate().filter(kept).map(lambda i, e: (batch_of(i), e))
    for m in reversed(maps):
        own = _map_again(own, m)
    parts = own.group_by_window(
        key_func=lambda b, e: b,
        reduce_func=lambda b, window: window.batch(share(b)).map(
            lambda bs, es: (rows_of_batch(bs[0]), es)
        ),
        window_size_func=share,
    )
    return RowsDataset(parts.prefetch(tf.data.AUTOTUNE), len(maps))


def _own(rows_of, rows):
    """This process's row ranges of a batch of `rows` rows; all of them
    where its share would be empty (a batch of fewer rows than processes)."""
    ranges = row_ranges.as_ranges(rows_of(rows))
    return ranges if _count(ranges) else [(0, rows)]


def _count(ranges):
    return sum(stop - start for start, stop in ranges)


def _batch_and_maps(dataset):
    """`(batch dataset, [maps, outermost first])`, or None."""
    node = dataset
    while type(node).__name__ in _PASSED_THROUGH:
        node = node._input_dataset
    if type(node).__name__ not in _BATCHES:
        return None
    batch, maps = node, []
    node = batch._input_dataset
    while type(node).__name__ in _MAPS:
        maps.append(node)
        node = node._input_dataset
    return (batch, maps) if maps else None


def _map_again(own, map_dataset):
    """`own`'s rows (`(batch index, element)`) through the same map."""
    function = getattr(map_dataset._map_func, TF_DATA_MAP_FUNCTION)
    parallel = getattr(map_dataset, "_num_parallel_calls", None)
    deterministic = {"true": True, "false": False}.get(
        getattr(map_dataset, "_deterministic", "default")
    )

    def apply(b, element):
        # Dataset.map's own unpacking: a tuple is passed as arguments.
        if type(element) is tuple:
            return b, function(*element)
        return b, function(element)

    return own.map(
        apply,
        num_parallel_calls=None if parallel is None else int(parallel),
        deterministic=deterministic,
    )
