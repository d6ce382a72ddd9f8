"""`chief_writes`: what process 0 wrote is there when the call
returns on any process, told through the run's store, never a collective.

Two processes are two threads here, over one store (the store of a run of
one process): the launched tests (test_jax_processes, test_torch_executor,
test_tensorflow_processes) prove it with real processes and files whose
writes land late.
"""

import json
import threading
import time

import pytest

from keras_parallel import ChiefWriteError
from keras_parallel.backends.base import LocalStore
from keras_parallel.run.chief_writes import Calls, ChiefWrites


@pytest.fixture
def store():
    return LocalStore()


def _as_process(store, is_chief, wait_s=10):
    """A `ChiefWrites` counting its calls alone, as a process of its own."""
    return ChiefWrites(store, is_chief, wait_s=wait_s, calls=Calls())


def test_the_other_process_returns_only_once_the_chief_has_written(store):
    chief, other = _as_process(store, True), _as_process(store, False)
    written = []
    returned_at = []

    def other_saves():
        with other.writing("save", "model.keras"):
            pass  # Writes nothing.
        returned_at.append(time.monotonic())

    thread = threading.Thread(target=other_saves)
    thread.start()
    time.sleep(0.3)
    assert not returned_at  # Still waiting: the chief has not written.
    with chief.writing("save", "model.keras"):
        written.append(time.monotonic())
    thread.join(10)
    assert returned_at and returned_at[0] >= written[0]


def test_calls_pair_by_their_count_per_kind(store):
    chief, other = _as_process(store, True), _as_process(store, False)
    with chief.writing("save", "a.keras"):
        pass
    with chief.writing("fit"):
        pass
    # The other's first save and first fit find the chief's: no wait.
    with other.writing("save", "a.keras"):
        pass
    with other.writing("fit"):
        pass
    assert json.loads(store.try_get("keras_parallel/chief_wrote/save/1")) == {
        "path": "a.keras",
        "error": None,
    }
    assert store.try_get("keras_parallel/chief_wrote/save/2") is None


def test_a_chief_that_failed_to_write_fails_the_call_on_the_others_naming_the_file(
    store,
):
    chief, other = _as_process(store, True), _as_process(store, False)
    with pytest.raises(OSError, match="disk full"):
        with chief.writing("save", "/data/model.keras"):
            raise OSError("disk full")
    with pytest.raises(ChiefWriteError) as raised:
        with other.writing("save", "/data/model.keras"):
            pass
    message = str(raised.value)
    assert "'/data/model.keras'" in message
    assert "OSError: disk full" in message
    assert "Process 0" in message


def test_nothing_is_waited_for_while_an_error_unwinds(store):
    other = _as_process(store, False)
    began = time.monotonic()
    with pytest.raises(ValueError, match="its own"):
        with other.writing("save", "model.keras"):
            raise ValueError("its own")
    assert time.monotonic() - began < 1  # No wait for the chief's record.


def test_a_record_keras_parallel_did_not_write_is_refused(store):
    store.set("keras_parallel/chief_wrote/save/1", "not json")
    other = _as_process(store, False)
    with pytest.raises(ChiefWriteError, match="not one keras_parallel wrote"):
        with other.writing("save", "model.keras"):
            pass


def test_a_process_counts_its_calls_across_runs():
    # Every `ChiefWrites` of a process counts on: a later run's records
    # never meet an earlier one's in a store that lives on.
    first = ChiefWrites(LocalStore(), is_chief=True)
    second = ChiefWrites(LocalStore(), is_chief=True)
    assert first.calls is second.calls


def test_saves_inside_an_entry_point_are_left_to_the_end_of_fit(store):
    # The chief alone runs a ModelCheckpoint (torch, TensorFlow): its saves
    # inside `fit` count nowhere, so the first save after `fit` pairs with
    # the other's first, and `fit`'s end waits for the checkpoints.
    chief, other = _as_process(store, True), _as_process(store, False)
    with chief.entry_point():
        with chief.writing("save", "checkpoint.keras"):
            pass
        with chief.writing("fit"):
            pass
    with chief.writing("save", "model.keras"):
        pass
    with other.entry_point():
        with other.writing("fit"):
            pass
    with other.writing("save", "model.keras"):
        pass
    record = json.loads(store.try_get("keras_parallel/chief_wrote/save/1"))
    assert record["path"] == "model.keras"


def test_no_record_within_the_wait_is_named(store):
    other = _as_process(store, False, wait_s=0.2)
    with pytest.raises(TimeoutError, match="did not say within 0 s"):
        with other.writing("save", "model.keras"):
            pass
