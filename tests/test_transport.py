"""The divided input's transport (`keras_parallel/input/transport.py`), on
in-process stand-ins for the executors' store and collectives; the launched
runs that use it are in tests/test_*_divided_input.py."""

import pickle

import numpy as np
import pytest

from keras_parallel.input import transport
from keras_parallel.messages import wire
from keras_parallel.messages.wire import WireFormatError


class Store:
    """A key-value store shared by the processes of a test."""

    def __init__(self):
        self.values = {}
        self.writes = []

    def put_bytes(self, key, payload):
        assert key not in self.values, f"{key} written twice"
        self.values[key] = payload
        self.writes.append((key, payload))

    def take_bytes(self, key):
        return self.values.pop(key, None)  # None: the reader gave up.


def _batch(rows):
    return (np.arange(rows * 2, dtype="float32").reshape(rows, 2), np.ones(rows))


def test_each_process_takes_its_own_part_from_the_store():
    store = Store()
    owner = transport.Handout(1, 3, store=store)
    parts = [(8, _batch(2)), (8, _batch(3)), (8, _batch(3))]
    key = transport.batch_key(4, 7)
    assert owner.give(key, 1, parts) is parts[1]  # Its own, not sent.
    assert sorted(store.values) == [f"{key}/0", f"{key}/2"]
    for process in (0, 2):
        rows, (x, y) = transport.Handout(process, 3, store=store).give(key, 1, None)
        assert rows == 8
        np.testing.assert_array_equal(x, parts[process][1][0])
        np.testing.assert_array_equal(y, parts[process][1][1])
    assert store.values == {}  # Each taken once.


def test_a_value_handed_to_every_process_is_encoded_once():
    store = Store()
    batch = _batch(4)
    transport.Handout(0, 4, store=store).give("k", 0, [batch] * 4)
    payloads = {id(payload) for _, payload in store.writes}
    assert len(store.writes) == 3 and len(payloads) == 1


def test_the_end_reaches_every_process_and_a_closed_reader_sees_it():
    store = Store()
    transport.Handout(0, 3, store=store).end("k", 0)
    for process in (1, 2):
        taken = transport.Handout(process, 3, store=store).give("k", 0, None)
        assert transport.is_end(taken)
    # Nothing written, the entry point closed: the reader gives up.
    assert transport.is_end(transport.Handout(1, 3, store=store).give("j", 0, None))
    assert not transport.is_end("another string")


def test_a_crafted_payload_is_refused_naming_the_key_and_the_owner(tmp_path):
    marker = tmp_path / "ran"

    class OpensFile:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    store = Store()
    key = transport.batch_key(0, 3)
    store.put_bytes(f"{key}/1", pickle.dumps(OpensFile()))
    receiver = transport.Handout(1, 2, store=store, who="worker")
    with pytest.raises(WireFormatError, match=f"'{key}' from worker 0"):
        receiver.give(key, 0, None)
    assert not marker.exists()


def test_a_scatter_moves_every_part_and_the_owner_decodes_its_own_too():
    sent = {}

    def scatter_bytes(payloads, owner):
        if payloads is not None:
            sent["payloads"] = payloads
        return sent["payloads"][rank]

    parts = [(6, _batch(3)), (6, _batch(3))]
    for rank in (0, 1):
        handout = transport.Handout(rank, 2, scatter_bytes=scatter_bytes, who="rank")
        rows, (x, _) = handout.give("a batch", 0, parts if rank == 0 else None)
        assert rows == 6
        np.testing.assert_array_equal(x, parts[rank][1][0])
    assert all(p.startswith(wire.MAGIC) for p in sent["payloads"])


def test_a_handout_moves_bytes_one_way():
    with pytest.raises(ValueError, match="moves bytes one way"):
        transport.Handout(0, 2)
    with pytest.raises(ValueError, match="moves bytes one way"):
        transport.Handout(0, 2, store=Store(), scatter_bytes=lambda p, o: b"")


def test_gathered_decodes_each_process_and_none_where_it_made_nothing():
    payloads = [wire.encode({"x": np.ones(2)}), b""]
    made = transport.gathered(payloads[0], lambda _: payloads, where="batch")
    np.testing.assert_array_equal(made[0]["x"], np.ones(2))
    assert made[1] is None
    with pytest.raises(WireFormatError, match="batch from process 1"):
        transport.gathered(b"", lambda _: [b"", b"\x80junk"], where="batch")


def test_every_loader_shuffles_from_process_0s_random_state():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    process_0 = torch.get_rng_state().numpy().tobytes()
    torch.manual_seed(1)  # This process's own state differs.
    loader = DataLoader(list(range(16)), batch_size=4, shuffle=True)
    transport.share_torch_random_state(loader, lambda _: process_0)
    order = [b.tolist() for b in loader]
    torch.manual_seed(0)
    assert order == [b.tolist() for b in loader]

    generator = torch.Generator().manual_seed(5)
    own = DataLoader(list(range(16)), batch_size=4, shuffle=True, generator=generator)
    shared = torch.Generator().manual_seed(9).get_state().numpy().tobytes()
    transport.share_torch_random_state(own, lambda _: shared)
    assert torch.equal(
        generator.get_state(), torch.Generator().manual_seed(9).get_state()
    )
