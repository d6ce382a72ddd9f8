"""What kind of input Keras reads, whether it can be divided, and the line
the chief prints about it."""

import random

#: The input's kind, by the class name of Keras's data adapter.
INPUT_KINDS = {
    "ArrayDataAdapter": "arrays",
    "TorchDataLoaderAdapter": "DataLoader",
    "GeneratorDataAdapter": "generator",
    "PyDatasetAdapter": "PyDataset",
    "TFDatasetAdapter": "tf.data",
    "GrainDatasetAdapter": "Grain",
}


def input_kind(adapter):
    """The kind of input a Keras data adapter reads (`"PyDataset"`, ...)."""
    name = type(adapter).__name__
    return INPUT_KINDS.get(name, name)


def input_line(kind, divided, processes, how=None):
    """The line the chief prints on how an input is divided, when it first reads one.

    Args:
        kind: the input's kind (`input_kind`).
        divided: whether each process prepares only its share.
        processes: the number of processes.
        how: for a divided `PyDataset`, how its batches reach the processes.
    """
    if divided and kind == "PyDataset":
        return (
            f"Input: PyDataset, batches made round-robin by {processes} "
            f"processes, {how or 'each process receiving its rows of every batch'}"
        )
    if divided and kind == "generator":
        return (
            f"Input: generator, drawn by process 0 alone, each of {processes} "
            "processes receiving its rows"
        )
    if divided and kind == "tf.data":
        return (
            f"Input: tf.data, each of {processes} processes maps only its rows "
            "of every global batch (the source and a shuffle before the maps "
            "run whole in each)"
        )
    if divided:
        return (
            f"Input: {kind}, each of {processes} processes loads its rows of "
            "every global batch"
        )
    return (
        f"Input: {kind}, read whole by each of {processes} processes, each "
        "keeping its rows (a map-style DataLoader, a PyDataset of one worker, "
        "a generator and a tf.data pipeline of a source of known length, "
        "maps and a batch divide the work; see docs/multihost.md)"
    )


def shareable_pydataset(adapter):
    """Whether the processes can make a `PyDataset`'s batches round-robin.

    Only where Keras makes them one by one, in order: with several workers
    its enqueuer shuffles on its own thread and goes on from where an earlier
    iteration stopped, an order no process could reproduce (such a dataset is
    read whole by every process). And not where Keras 3.16 shards them
    between processes itself (`_num_data_shards`): each reads its own already.
    """
    dataset = adapter.py_dataset
    return (
        dataset.num_batches is not None
        and int(dataset.workers or 0) <= 1
        and not dataset.use_multiprocessing
        and int(getattr(adapter, "_num_data_shards", 1) or 1) <= 1
    )


def epoch_order(adapter, num_batches):
    """The order of a `PyDataset`'s batches this epoch, as Keras's adapter
    makes it: shuffled with Python's shared random state (Keras 3.15), or
    seeded by the adapter's count of epochs (`_epoch`, Keras 3.16)."""
    order = list(range(num_batches))
    if adapter.shuffle:
        epoch = getattr(adapter, "_epoch", None)
        if isinstance(epoch, int):
            random.Random(epoch).shuffle(order)
        else:
            random.shuffle(order)
    return order
