"""The run's store, every value tagged with the run's secret.

The stores the processes of a run talk through (JAX's coordination service,
torch's `TCPStore`, TensorFlow's coordination service) admit whoever
reaches them, and keras_parallel's keys are predictable: a value written
first under a real key could inject a batch, force a run-wide stop or
plant a failure message. Every value keras_parallel writes there carries
an HMAC-SHA256 tag of the run's secret (`run_secret`), bound to its key and
its sender, as Python's `multiprocessing.connection` binds its messages to
an authkey. A value without a valid tag is refused with an
`UntrustedValueError` naming the key and the sender it claims, and nothing
of it is used.

A text value is stored as `kp1:<sender>:<tag, 64 hex digits>:<value>`; a
bytes value as `b"KPS1"`, the sender (4 bytes, big-endian), the tag (32
bytes) and the value.

Example:

```python
store = SignedStore(executor_store, secret=b"...", sender=0)
store.set("keras_parallel/stop/1/notice", "0:SIGTERM")
store.try_get("keras_parallel/stop/1/notice")  # "0:SIGTERM", checked
```
"""

import hashlib
import hmac

_TEXT_MAGIC = "kp1"
_BYTES_MAGIC = b"KPS1"
_TAG_BYTES = 32


class UntrustedValueError(RuntimeError):
    """A value in the run's store without the run's tag: not used."""


class KeyAlreadySetError(RuntimeError):
    """A write found its key already holding another value (a store that
    keeps a key's first value: TensorFlow's coordination service)."""


def tag(secret, key, sender, value):
    """The HMAC-SHA256 of `value` (bytes) under `key`, from `sender`."""
    message = b"\0".join([_TEXT_MAGIC.encode(), key.encode(), str(sender).encode()])
    return hmac.new(secret, message + b"\0" + value, hashlib.sha256).digest()


def signed_text(secret, key, sender, value):
    """`value` (a string) as stored under `key` by `sender`."""
    digest = tag(secret, key, sender, value.encode()).hex()
    return f"{_TEXT_MAGIC}:{sender}:{digest}:{value}"


def checked_text(secret, key, stored, sender=None):
    """The value `signed_text` stored under `key`, once its tag is checked.

    Args:
        secret: the run's secret.
        key: the key it was read from.
        stored: what the store held (a string, or bytes).
        sender: the process that must have written it (None: any).

    Returns:
        `(sender, value)`.

    Raises:
        UntrustedValueError: no valid tag of this run, key and sender.
    """
    if isinstance(stored, bytes):
        stored = stored.decode("utf-8", "replace")
    magic, claimed, digest, value = (stored.split(":", 3) + ["", "", ""])[:4]
    ok = magic == _TEXT_MAGIC and claimed.isdigit() and len(digest) == 64
    if ok:
        expected = tag(secret, key, int(claimed), value.encode()).hex()
        ok = hmac.compare_digest(expected, digest)
    _check(ok, key, int(claimed) if claimed.isdigit() else None, sender, stored[:40])
    return int(claimed), value


def signed_bytes(secret, key, sender, payload):
    """`payload` (bytes) as stored under `key` by `sender`."""
    return (
        _BYTES_MAGIC
        + int(sender).to_bytes(4, "big")
        + tag(secret, key, sender, payload)
        + payload
    )


def checked_bytes(secret, key, stored, sender=None):
    """The payload `signed_bytes` stored under `key`, its tag checked.

    Returns:
        `(sender, payload)`.

    Raises:
        UntrustedValueError: no valid tag of this run, key and sender.
    """
    stored = bytes(stored)
    head = len(_BYTES_MAGIC) + 4 + _TAG_BYTES
    ok = stored[: len(_BYTES_MAGIC)] == _BYTES_MAGIC and len(stored) >= head
    claimed = int.from_bytes(stored[4:8], "big") if ok else None
    if ok:
        payload = stored[head:]
        ok = hmac.compare_digest(
            tag(secret, key, claimed, payload), stored[8 : 8 + _TAG_BYTES]
        )
    _check(ok, key, claimed, sender, stored[:16])
    return claimed, stored[head:]


def _check(ok, key, claimed, sender, received):
    if ok and (sender is None or claimed == sender):
        return
    who = "an unknown sender" if claimed is None else f"process {claimed}"
    if ok:
        why = f"it was written by {who}, not by process {sender}"
    else:
        why = f"it claims {who} and does not carry this run's tag"
    raise UntrustedValueError(
        f"the value under {key!r} in the run's store was refused, and nothing "
        f"of it was used: {why}. Received: {received!r}; every process of a "
        "run must share its secret (KERAS_PARALLEL_RUN_SECRET or "
        "KERAS_PARALLEL_RUN_SECRET_FILE), and nothing else may write to its "
        'store (docs/multihost.md, "Network and trust").'
    )


class SignedStore:
    """A store whose values carry this run's tag, checked when read.

    Args:
        store: the backend's store: `set(key, text)`, `try_get(key)`, and
            where it has them `delete(key)`, `put_bytes(key, payload)`,
            `take_bytes(key)`.
        secret: the run's secret (bytes; `b""` where the run has none:
            tagged, not authenticated).
        sender: this process's index in the run.
    """

    def __init__(self, store, secret, sender):
        self.store = store
        self.secret = secret or b""
        self.sender = int(sender)

    def set(self, key, value):
        self.store.set(key, signed_text(self.secret, key, self.sender, value))

    def try_get(self, key):
        stored = self.store.try_get(key)
        if stored is None:
            return None
        return checked_text(self.secret, key, stored)[1]

    def delete(self, key):
        self.store.delete(key)

    def put_bytes(self, key, payload):
        self.store.put_bytes(
            key, signed_bytes(self.secret, key, self.sender, bytes(payload))
        )

    def take_bytes(self, key, sender=None):
        stored = self.store.take_bytes(key)
        if stored is None:
            return None
        return checked_bytes(self.secret, key, stored, sender)[1]


def for_run(store, sender):
    """`store`, its values tagged with this process's run secret
    (`run_secret.run_secret`)."""
    from keras_parallel.messages import run_secret

    return SignedStore(store, run_secret.run_secret(), sender)
