"""The executor contract (`backends/base.py`): collectives never lie.

With one process every collective returns its input. With several, a
backend that does not implement one raises, rather than acting as an
identity that would let processes drift apart silently.
"""

import random

import numpy as np
import pytest

from keras_parallel.backends.base import Executor
from keras_parallel.messages import wire


class _Executor(Executor):
    backend = "test"

    def __init__(self, processes=1, index=0):
        super().__init__(distribution=None)
        self._processes = processes
        self._index = index
        self.sent = []

    @classmethod
    def list_devices(cls):
        return ["cpu:0"]

    def apply(self, model, plan):
        pass

    @property
    def num_processes(self):
        return self._processes

    @property
    def process_index(self):
        return self._index


def test_collectives_are_identities_in_one_process():
    executor = _Executor()
    assert executor.reduce(3.0) == 3.0
    assert executor.broadcast({"a": 1}) == {"a": 1}
    executor.barrier()
    state = random.getstate()
    executor.share_host_random_state()
    assert random.getstate() == state


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.reduce(1.0),
        lambda e: e.broadcast(1),
        lambda e: e.barrier(),
        lambda e: e.share_host_random_state(),
    ],
)
def test_unimplemented_collectives_raise_across_processes(call):
    with pytest.raises(NotImplementedError, match="no `.*` across processes"):
        call(_Executor(processes=2))


class _Relay(_Executor):
    """Two processes in one: `broadcast_bytes` hands back what process 0 sent."""

    def __init__(self, payload_from_process_0, **kwargs):
        super().__init__(**kwargs)
        self.payload = payload_from_process_0

    def broadcast_bytes(self, payload, src=0):
        return self.payload


def test_random_state_comes_from_process_0():
    np.random.seed(1)
    random.seed(1)
    process_0 = _Executor()
    payload = wire.encode(process_0.checkpoint_io.host_random_state())
    expected = (np.random.rand(), random.random())
    np.random.seed(2)  # Process 1 seeded otherwise.
    random.seed(2)
    _Relay(payload, processes=2, index=1).share_host_random_state()
    assert (np.random.rand(), random.random()) == expected
