"""`keras_parallel.messages.signed_store`: the run's store, every value tagged."""

import pytest
from backend_neutral import once

from keras_parallel.backends.base import LocalStore
from keras_parallel.messages import signed_store
from keras_parallel.messages.signed_store import SignedStore, UntrustedValueError

pytestmark = once
SECRET = b"the run's secret"


class BytesStore(LocalStore):
    """A dict with the byte methods of a `transport.Handout`'s store."""

    def put_bytes(self, key, payload):
        self._values[key] = payload

    def take_bytes(self, key):
        return self._values.pop(key, None)

    def delete(self, key):
        self._values.pop(key, None)


def test_a_value_comes_back_as_written_and_is_tagged_in_the_store():
    raw = BytesStore()
    store = SignedStore(raw, SECRET, sender=1)
    store.set("keras_parallel/stop/1/notice", "1:SIGTERM")
    assert store.try_get("keras_parallel/stop/1/notice") == "1:SIGTERM"
    assert raw.try_get("keras_parallel/stop/1/notice").startswith("kp1:1:")
    assert store.try_get("not written") is None
    store.put_bytes("batch/0", b"\x00rows")
    assert store.take_bytes("batch/0") == b"\x00rows"
    assert store.take_bytes("batch/0") is None


@pytest.mark.parametrize(
    "forged",
    ["0:SIGTERM", "kp1:0:" + "0" * 64 + ":0:SIGTERM", "kp1:x:y:z", ""],
)
def test_a_value_written_without_the_secret_is_refused_naming_key_and_sender(forged):
    # A forced stop planted under the real key by someone who reached the
    # store: refused, nothing of it returned.
    raw = BytesStore()
    raw.set("keras_parallel/stop/1/notice", forged)
    store = SignedStore(raw, SECRET, sender=1)
    with pytest.raises(UntrustedValueError, match="'keras_parallel/stop/1/notice'"):
        store.try_get("keras_parallel/stop/1/notice")


def test_another_secret_another_key_or_another_value_is_refused():
    raw = BytesStore()
    SignedStore(raw, b"another run's secret", sender=0).set("a", "stop")
    with pytest.raises(UntrustedValueError, match="claims process 0"):
        SignedStore(raw, SECRET, sender=1).try_get("a")
    # The run's own value, moved to another key or altered.
    SignedStore(raw, SECRET, sender=0).set("a", "stop")
    raw.set("b", raw.try_get("a"))
    with pytest.raises(UntrustedValueError, match="'b'"):
        SignedStore(raw, SECRET, sender=1).try_get("b")
    raw.set("a", raw.try_get("a")[:-4] + "go!!")
    with pytest.raises(UntrustedValueError):
        SignedStore(raw, SECRET, sender=1).try_get("a")


def test_a_forged_batch_is_refused_and_a_batch_is_bound_to_its_sender():
    raw = BytesStore()
    raw.put_bytes("batch/1", b"KPW1 a crafted payload")
    store = SignedStore(raw, SECRET, sender=1)
    with pytest.raises(UntrustedValueError, match="an unknown sender"):
        store.take_bytes("batch/1")
    SignedStore(raw, SECRET, sender=2).put_bytes("batch/1", b"rows")
    with pytest.raises(UntrustedValueError, match="written by process 2, not by"):
        store.take_bytes("batch/1", sender=0)
    payload = signed_store.signed_bytes(SECRET, "batch/1", 0, b"rows")
    raw.put_bytes("batch/1", payload[:-1] + b"!")
    with pytest.raises(UntrustedValueError):
        store.take_bytes("batch/1")


def test_without_a_secret_values_are_still_tagged_and_bound_to_their_key():
    raw = BytesStore()
    SignedStore(raw, None, sender=0).set("a", "stop")
    assert SignedStore(raw, b"", sender=1).try_get("a") == "stop"
    raw.set("b", raw.try_get("a"))
    with pytest.raises(UntrustedValueError):
        SignedStore(raw, None, sender=1).try_get("b")
