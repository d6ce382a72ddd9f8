"""What the chief wrote is there for every process when the call returns.

Process 0 alone writes `model.save`'s file, `save_weights`' and a
`ModelCheckpoint`'s; the other processes write nothing. Without more, they
return at once, and a script that saves and then loads on every process
(the next stage of a pipeline, an export, an evaluation) finds no file, or
the previous epoch's. So each process counts its writing calls alike (a
save; the end of a `fit`), and for each the chief leaves a record in the
run's key-value store once its write is done (or failed); the others wait
for the record before they return. A record is a store read, not a
collective: nothing is joined while an exception unwinds, and a chief that
failed to write fails the same call on every process, naming the file.

Example:

```python
writes = ChiefWrites(executor.key_value_store(), executor.is_chief)
with writes.writing("save", "model.keras"):
    ...  # The chief writes; the others write nothing.
# Returned on every process: the chief's file is in place.
```
"""

import contextlib
import json
import time

from keras_parallel.errors import ChiefWriteError

#: Where the records live in the store: `<prefix><kind>/<count>`.
KEY_PREFIX = "keras_parallel/chief_wrote/"
#: How long a process waits for the chief's record (a chief that died ends
#: the run by its launcher well before).
WAIT_S = 1800.0
#: The first and the longest pause between two reads of the store.
FIRST_POLL_S = 0.005
LONGEST_POLL_S = 0.2


class Calls:
    """The writing calls of one process: counted per kind, and whether an
    entry point runs (a save then is not paired: `fit`'s end is).

    Every process makes the same calls in the same order (their
    collectives need it), so the n-th save here is the chief's n-th. A
    save from a callback inside `fit` is not: the chief alone runs a
    `ModelCheckpoint` on torch and TensorFlow, so such saves are left
    uncounted on every process, and the end of `fit` waits for them all.
    """

    def __init__(self):
        self.counts = {}
        self.entry_points = 0


#: This process's calls: counted per process, not per executor, so that a
#: later run's records never meet an earlier one's.
PROCESS_CALLS = Calls()


class ChiefWrites:
    """Records of the chief's writes, in the run's key-value store.

    Args:
        store: the processes' store (`Executor.key_value_store()`): `set`,
            `try_get`, string values.
        is_chief: whether this process writes (process 0).
        wait_s: how long a process waits for a record before it gives up.
        calls: where calls are counted (`Calls`); by default this
            process's, shared by every `ChiefWrites` of the process.
    """

    def __init__(self, store, is_chief, wait_s=WAIT_S, calls=None):
        self.store = store
        self.is_chief = is_chief
        self.wait_s = wait_s
        self.calls = PROCESS_CALLS if calls is None else calls

    def writing(self, kind, path=None):
        """A context for one writing call of `kind` (`"save"`, `"fit"`).

        A save while an entry point runs (`entry_point`; a callback's) is
        not paired on its own: the end of `fit` covers it.

        On the chief, its body writes; on leaving, the record says done, or
        (the body raised) the error, and the error goes on. On the other
        processes the body writes nothing (it may join a collective the
        chief's write needs); on leaving without an error, the process
        waits for the chief's record of the same call.

        Args:
            kind: the kind of call; each kind is counted on its own.
            path: the file written, for the error, where one is known.

        Raises:
            ChiefWriteError: (not on the chief) the chief's write failed.
            TimeoutError: (not on the chief) no record came within `wait_s`.
        """
        if kind == "save" and self.calls.entry_points:
            return contextlib.nullcontext()  # Paired by the end of `fit`.
        count = self.calls.counts.get(kind, 0) + 1
        self.calls.counts[kind] = count
        return _Writing(self, f"{KEY_PREFIX}{kind}/{count}", kind, path)

    @contextlib.contextmanager
    def entry_point(self):
        """While an entry point runs: its saves are left to `fit`'s end."""
        self.calls.entry_points += 1
        try:
            yield
        finally:
            self.calls.entry_points -= 1

    def publish(self, key, path, error):
        record = {"path": None if path is None else str(path), "error": error}
        self.store.set(key, json.dumps(record))

    def wait(self, key, kind, path):
        deadline = time.monotonic() + self.wait_s
        pause = FIRST_POLL_S
        while True:
            value = self.store.try_get(key)
            if value is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Process 0 (the chief) did not say within {self.wait_s:.0f} s "
                    f"that it wrote {_what(kind, path)}. Received: no record "
                    f"under {key!r} in the run's store; see process 0's output "
                    "for why it stopped."
                )
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_POLL_S)
        try:
            record = json.loads(value)
            error = record["error"]
            written = record["path"]
        except (ValueError, TypeError, KeyError):
            raise ChiefWriteError(
                f"The chief's record of {_what(kind, path)} is not one "
                f"keras_parallel wrote. Received: {value[:200]!r} under {key!r}; "
                "run one keras_parallel version on every process."
            ) from None
        if error is not None:
            raise ChiefWriteError(
                f"Process 0 (the chief) failed to write {_what(kind, written)}, "
                f"so this process has no such file either. Received from "
                f"process 0: {error}; fix the chief's error (its traceback is "
                "in process 0's output) and run again."
            )


class _Writing:
    def __init__(self, writes, key, kind, path):
        self.writes, self.key, self.kind, self.path = writes, key, kind, path

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback):
        writes = self.writes
        if writes.is_chief:
            message = None if error is None else f"{error_type.__name__}: {error}"
            writes.publish(self.key, self.path, message and message[:2000])
        elif error is None:
            writes.wait(self.key, self.kind, self.path)
        return False


def _what(kind, path):
    if path is not None:
        return repr(str(path))
    return "what its `fit` writes" if kind == "fit" else f"its {kind}"
