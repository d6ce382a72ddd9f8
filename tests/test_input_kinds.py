"""The input's kind, whether a PyDataset can be divided, its epoch order,
and the line the chief prints about it (`keras_parallel.input.kinds`)."""

import random

import keras
import numpy as np
import pytest
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

from keras_parallel.input import kinds


class Recorded(keras.utils.PyDataset):
    """10 batches, recording the order Keras asks for them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.asked = []

    def __len__(self):
        return 10

    def __getitem__(self, i):
        self.asked.append(i)
        return np.zeros((2, 1)), np.zeros((2,))


def test_kinds_are_named_by_keras_adapter():
    dataset = Recorded()
    assert kinds.input_kind(PyDatasetAdapter(dataset)) == "PyDataset"

    class Unknown:
        pass

    assert kinds.input_kind(Unknown()) == "Unknown"


@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_order_is_the_order_keras_makes_batches_in(shuffle):
    dataset = Recorded()
    adapter = PyDatasetAdapter(dataset, shuffle=shuffle)
    state = random.getstate()
    expected = kinds.epoch_order(adapter, 10)
    random.setstate(state)
    for _ in adapter.get_numpy_iterator():
        pass
    assert dataset.asked == expected
    assert sorted(expected) == list(range(10))
    if shuffle:
        assert expected != list(range(10))


def test_only_a_pydataset_made_in_order_is_shared():
    assert kinds.shareable_pydataset(PyDatasetAdapter(Recorded()))
    # Keras's enqueuer makes batches on threads, in an order of its own.
    assert not kinds.shareable_pydataset(PyDatasetAdapter(Recorded(workers=2)))


def test_the_line_says_how_each_input_is_divided():
    assert kinds.input_line("DataLoader", True, 2) == (
        "Input: DataLoader, each of 2 processes loads its rows of every global batch"
    )
    assert kinds.input_line("generator", True, 4) == (
        "Input: generator, drawn by process 0 alone, each of 4 processes "
        "receiving its rows"
    )
    assert "read whole by each of 2 processes" in kinds.input_line("tf.data", False, 2)
    line = kinds.input_line("PyDataset", True, 2, how="each receiving all")
    assert line == (
        "Input: PyDataset, batches made round-robin by 2 processes, each receiving all"
    )
