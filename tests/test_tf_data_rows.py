"""A `tf.data` pipeline read as one process's rows of its global batches:
the processes' rows together are each global batch, epoch after epoch, and
a pipeline that cannot be divided is left to be read whole."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from keras_parallel.input import tf_data_rows  # noqa: E402

X = np.arange(43 * 3, dtype=np.float32).reshape(43, 3)
Y = np.arange(43)


def decode(x, y):
    return x * 2, y + 1


def pipeline(drop_remainder=False):
    """The guide's shape: slices, a seeded reshuffling shuffle, maps (one
    parallel), a batch with a partial last one (43 = 5 x 8 + 3), prefetch."""
    return (
        tf.data.Dataset.from_tensor_slices((X, Y))
        .shuffle(50, seed=3)
        .map(decode, num_parallel_calls=2)
        .map(lambda x, y: (x + 1, y))
        .batch(8, drop_remainder=drop_remainder)
        .prefetch(2)
    )


def process_rows(processes, process):
    return lambda rows: (rows * process // processes, rows * (process + 1) // processes)


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("processes", [2, 3])
def test_the_processes_rows_are_each_global_batch_every_epoch(
    drop_remainder, processes
):
    whole = pipeline(drop_remainder)
    epochs = [list(whole.as_numpy_iterator()) for _ in range(2)]
    # The shuffle draws another order each epoch, alike in every process.
    assert not np.array_equal(epochs[0][0][1], epochs[1][0][1])
    own = []
    for process in range(processes):
        source = pipeline(drop_remainder)  # Each process's own copy.
        rows = tf_data_rows.rows_dataset(source, process_rows(processes, process))
        assert rows.maps == 2
        own.append([list(rows.dataset.as_numpy_iterator()) for _ in range(2)])
    for epoch, batches in enumerate(epochs):
        for i, (x, y) in enumerate(batches):
            parts = [p[epoch][i] for p in own]
            assert {int(rows) for rows, _ in parts} == {len(y)}
            # Each process holds only its rows, in order.
            for process, (_, (px, _)) in enumerate(parts):
                start, stop = process_rows(processes, process)(len(y))
                assert len(px) == stop - start
            np.testing.assert_array_equal(np.concatenate([p[1][0] for p in parts]), x)
            np.testing.assert_array_equal(np.concatenate([p[1][1] for p in parts]), y)
        assert all(len(p[epoch]) == len(batches) for p in own)


def test_a_process_may_hold_several_ranges_of_each_batch():
    # As a TensorFlow worker's 2 replicas hold slices w and 2 + w of 4.
    def slices(worker):
        return lambda rows: [
            (rows * k // 4, rows * (k + 1) // 4) for k in (worker, 2 + worker)
        ]

    whole = list(pipeline().as_numpy_iterator())
    own = [
        list(
            tf_data_rows.rows_dataset(pipeline(), slices(w)).dataset.as_numpy_iterator()
        )
        for w in (0, 1)
    ]
    for i, (x, _) in enumerate(whole):
        (a, b), (c, d) = slices(0)(len(x))
        np.testing.assert_array_equal(own[0][i][1][0], np.concatenate([x[a:b], x[c:d]]))
        (a, b), (c, d) = slices(1)(len(x))
        np.testing.assert_array_equal(own[1][i][1][0], np.concatenate([x[a:b], x[c:d]]))


def test_a_share_that_would_be_empty_is_the_whole_batch():
    # 3 rows over 4 processes: process 0's share of the last batch is empty.
    rows = tf_data_rows.rows_dataset(pipeline(), process_rows(4, 0))
    last_rows, (x, _) = list(rows.dataset.as_numpy_iterator())[-1]
    assert last_rows == 3 and len(x) == 3


def test_an_endless_pipeline_has_only_full_batches():
    endless = tf.data.Dataset.from_tensor_slices(X).repeat().map(lambda x: x * 3)
    rows = tf_data_rows.rows_dataset(endless.batch(8), process_rows(2, 1))
    parts = list(rows.dataset.take(12).as_numpy_iterator())
    assert [int(r) for r, _ in parts] == [8] * 12
    np.testing.assert_array_equal(parts[0][1], X[4:8] * 3)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: d.batch(8),  # No map: nothing to divide.
        lambda d: d.batch(8).map(lambda x: x * 2),  # A map of whole batches.
        lambda d: (
            d.map(lambda x: x).filter(lambda x: x[0] > 3).map(tf.identity).batch(8)
        ),
        lambda d: d.map(tf.identity).padded_batch(8),
    ],
    ids=["no_map", "map_after_batch", "unknown_length", "padded_batch"],
)
def test_a_pipeline_it_cannot_divide_is_read_whole(make):
    dataset = make(tf.data.Dataset.from_tensor_slices(X))
    assert tf_data_rows.rows_dataset(dataset, process_rows(2, 0)) is None


def test_every_tf_data_internal_read_exists_in_this_tensorflow():
    # Built through the public API, each private class holds what is read.
    slices = tf.data.Dataset.from_tensor_slices(X)
    made = [
        slices.batch(2),
        slices.batch(2, num_parallel_calls=2),
        slices.map(tf.identity),
        slices.map(tf.identity, num_parallel_calls=2),
        slices.prefetch(1),
        slices.with_options(tf.data.Options()),
    ]
    found = {type(d).__name__: d for d in made}
    assert set(found) == set(tf_data_rows.TF_DATA_INTERNALS)
    for name, attributes in tf_data_rows.TF_DATA_INTERNALS.items():
        for attribute in attributes:
            assert hasattr(found[name], attribute), (name, attribute)
    assert callable(found["_MapDataset"]._map_func._func)
