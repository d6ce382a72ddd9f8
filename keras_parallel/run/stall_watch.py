"""A stalled process named, with its stack, instead of a silent hang.

Every process of several counts where it is in the entry point: each
epoch's and batch's begin and end, as Keras's callback list calls them (the
data of a training batch is drawn before its `on_train_batch_begin`, so a
process stuck in its data loader has not begun the batch the others are
in). It publishes that position to the run's key-value store at the
heartbeat's tick (`run/heartbeat.py`): no collective, about one request a
second per process, shared with the preemption's stop agreement.

A process whose position has not moved for the stall timeout reads every
process's. If some process is behind one that has waited for the timeout
(finished a step it has not, and not moved since), or some process has
waited for the timeout for its part of a batch, that process has stalled:

- the stalled process prints the report: its rank, host and pid, the epoch
  and batch it stopped in and for how long; its Python stack, every
  thread; each other process's position and where its main thread waits;
- every process exits with `STALLED_EXIT_CODE`. No collective runs (the
  stalled process would never join it); the last backup stays, so the
  same command resumes.

Every process alike slow (a long first compile, a slow save at an epoch's
end on every process) is no stall: no process is behind, or none has
waited for the timeout for it (on busy cores one process's compile may end
a minute before another's: the other is slow, not stalled).

Through `keras-parallel launch` the report is the only one; under another
launcher (torchrun, srun, mpirun) each waiting process also prints one line
pointing to it.
"""

import contextlib
import json
import multiprocessing
import os
import socket
import sys
import time

from keras_parallel.messages.signed_store import KeyAlreadySetError, UntrustedValueError
from keras_parallel.run.stall_positions import (
    decode_record,
    main_thread_waits_in,
    stall_report,
    stalled_processes,
    thread_stacks,
)
from keras_parallel.run.stall_settings import (
    STALLED_EXIT_CODE,
)

#: Seconds the stalled process waits for the others' positions, and the
#: others for its report, before going on without (each other process
#: writes where it waits once it has not moved for the timeout: on busy
#: cores, seconds after the stalled one; at once in the common case).
REPORT_WAIT_S = 30.0
#: Seconds between two looks at every process's position while this one
#: has not moved for the timeout and no process is behind (every process
#: alike slow): at least this, and a tenth of a second per process, so that
#: a long compile on many processes costs the store little.
LOOK_EVERY_S = 10.0
#: Seconds a waiting process lets the stalled one exit first, so that a
#: launcher names the stalled process as the run's failure.
EXIT_AFTER_S = 2.0


class StallWatch:
    """Names a process that stalls while the others wait, then ends the run.

    Args:
        store: the run's key-value store (`set`, `try_get`; strings).
        rank: this process's index.
        num_processes: how many processes run.
        prefix: the entry point's keys' prefix (the same on every process).
        timeout: the stall timeout in seconds.
        launched: under `keras-parallel launch` (one report in all).
        clock: `time.monotonic`, or a test's.
        exit: `os._exit`, or a test's.
        sleep: `time.sleep`, or a test's.

    Example:

    ```python
    watch = StallWatch(LocalStore(), 0, 2, "fit-1", timeout=180.0)
    watch.moved("on_train_batch_begin", batch=0)
    watch.tick()  # from the run's heartbeat, once a second
    ```
    """

    def __init__(
        self,
        store,
        rank,
        num_processes,
        prefix,
        timeout,
        launched=False,
        clock=time.monotonic,
        exit=os._exit,
        sleep=time.sleep,
    ):
        self.store = store
        self.rank = rank
        self.num_processes = num_processes
        self.prefix = prefix
        self.timeout = timeout
        self.launched = launched
        self.clock = clock
        self._exit = exit
        self._sleep = sleep
        self.moves = 0
        self.epoch = None
        self.batch = None
        self.event = ""
        #: The process whose part of a divided batch this one waits for.
        self.waits_for = None
        self._waits_since = None
        self._moved_at = clock()
        self._published = None
        self._ticks = 0
        self._waiting_since = None
        self._next_look = None
        self._report_due = None
        self._ended = False
        #: The keys whose value the store refused (`_read`).
        self._refused = set()

    # ------------------------------------------------------- main thread
    def moved(self, event, epoch=None, batch=None):
        """Records one step of Keras's loop (a callback-list event)."""
        self.moves += 1
        self.event = event
        if event.startswith("on_epoch"):
            self.epoch = epoch
            self.batch = None
        else:
            self.batch = batch
            if epoch is not None:
                self.epoch = epoch
        self._moved_at = self.clock()

    def wait_for(self, owner):
        """Marks this process as waiting for process `owner` (None: no
        longer waiting): `waiting_for` calls it."""
        self.waits_for = owner
        self._waits_since = None if owner is None else self.clock()

    def _waited(self, now):
        """Whether this process has waited for the timeout: for its part of
        a batch since that wait began, else since it last moved (ahead of
        another, it waits in the step's collective)."""
        since = self._moved_at
        if self.waits_for is not None and self._waits_since is not None:
            since = self._waits_since
        return now - since >= self.timeout

    # ------------------------------------------------- heartbeat thread
    def tick(self):
        """One heartbeat: publish a moved position every other tick (the
        stop agreement's notice poll takes the others); look at every
        process once this one has not moved for the timeout.

        Returns:
            False once the run has ended here (the heartbeat drops it).
        """
        if self._ended:
            return False
        self._ticks += 1
        now = self.clock()
        position = (self.moves, self.waits_for, self._waited(now))
        if position != self._published and self._ticks % 2 == 0:
            self._published = position
            self._replace(self._key("position", self.rank), self._record())
        if now - self._moved_at < self.timeout:
            self._next_look = None
        elif self._next_look is None or now >= self._next_look:
            self._look()
        return not self._ended

    def _record(self, **extra):
        record = {
            "moves": self.moves,
            "event": self.event,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if self.epoch is not None:
            record["epoch"] = self.epoch
        if self.batch is not None:
            record["batch"] = self.batch
        if self.waits_for is not None:
            record["waits_for"] = self.waits_for
        if self._waited(self.clock()):
            record["waited"] = 1
        record.update(extra)
        return json.dumps(record)

    def _key(self, name, rank=None):
        suffix = "" if rank is None else f"/{rank}"
        return f"keras_parallel/stall/{self.prefix}/{name}{suffix}"

    def _replace(self, key, value):
        # TensorFlow's coordination service keeps a key's first value: the
        # key is deleted first where the store can (a reader in between
        # finds none, and leaves that process out of its look).
        delete = getattr(self.store, "delete", None)
        if delete is not None:
            try:
                delete(key)
            except Exception:
                pass  # Not written yet.
        self.store.set(key, value)

    def _read(self, key):
        """The value under `key`, or None where the store refused it.

        A value without the run's tag (`signed_store.UntrustedValueError`:
        written by someone who reached the store) is not used, and said
        once; the watch goes on with what the processes themselves wrote
        (a refusal raised here would end the watch's tick for good).
        """
        try:
            return self.store.try_get(key)
        except UntrustedValueError as error:
            if not self._refused:
                print(
                    f"keras_parallel: process {self.rank}'s stall watch refused "
                    f"a value of the run's store and goes on without it: {error}",
                    file=sys.stderr,
                    flush=True,
                )
            self._refused.add(key)
            return None

    def _positions(self):
        """Every process's published position, by rank; a process whose
        position is not there (not published yet, or being replaced) is
        left out: every live process publishes within two ticks."""
        positions = {}
        for rank in range(self.num_processes):
            if rank == self.rank:
                positions[rank] = decode_record(self._record())
                continue
            text = self._read(self._key("position", rank))
            record = decode_record(text) if text is not None else None
            if record is not None:
                positions[rank] = record
        return positions

    def _look(self):
        positions = self._positions()
        behind = stalled_processes(positions)
        if not behind:
            # Every process alike: slow, not stalled. Looked at again later.
            self._waiting_since = None
            self._next_look = self.clock() + max(LOOK_EVERY_S, self.num_processes / 10)
            return
        stalled = min(behind, key=lambda r: (positions[r]["moves"], r))
        behind = set(behind)
        if self.rank == stalled:
            # The others' positions first (each writes where it waits at
            # its next look), for at most REPORT_WAIT_S.
            if self._report_due is None:
                self._report_due = self.clock() + REPORT_WAIT_S
            waiting = self._waiting_records(positions, stalled)
            if len(waiting) == self.num_processes - 1 or (
                self.clock() >= self._report_due
            ):
                self._report(positions, stalled, waiting, own_stack=True)
                self._end(stalled)
            return
        if self._waiting_since is None:
            self._waiting_since = self.clock()
            # Replaced: a process may wait, move on and wait again.
            self._replace(
                self._key("waiting", self.rank),
                self._record(waiting=main_thread_waits_in()),
            )
        if self._read(self._key("reported")) is not None:
            self._end(stalled)
        elif self.clock() - self._waiting_since > 2 * REPORT_WAIT_S:
            # Its watch did not answer (a native call holding the GIL):
            # the first waiting process reports what the store shows.
            if self.rank == min(r for r in positions if r not in behind):
                waiting = self._waiting_records(positions, stalled)
                self._report(positions, stalled, waiting, own_stack=False)
            self._end(stalled)

    def _waiting_records(self, positions, stalled):
        waiting = {}
        for rank in positions:
            if rank != stalled:
                text = self._read(self._key("waiting", rank))
                record = decode_record(text) if text is not None else None
                if record is not None:
                    waiting[rank] = record
        return waiting

    def _report(self, positions, stalled, waiting, own_stack):
        seconds = self.clock() - self._moved_at if own_stack else None
        stacks = thread_stacks() if own_stack else None
        text = stall_report(stalled, positions, waiting, self.timeout, seconds, stacks)
        print(text, file=sys.stderr, flush=True)
        try:
            self.store.set(self._key("reported"), str(stalled))
        except KeyAlreadySetError:
            pass  # Reported already (by the others, its watch late): one is enough.

    def _end(self, stalled):
        """Every process ends here, without a collective: the stalled one
        would never join it."""
        self._ended = True
        if self.rank != stalled:
            self._sleep(EXIT_AFTER_S)
        if not self.launched and self.rank != stalled:
            print(
                f"keras_parallel: process {self.rank} ends: process {stalled} "
                "stalled (its report is in its output). Exiting with code "
                f"{STALLED_EXIT_CODE}.",
                file=sys.stderr,
                flush=True,
            )
        sys.stdout.flush()
        # Its own children first (a DataLoader's workers, asleep where the
        # process stalled): nothing outlives it.
        for child in multiprocessing.active_children():
            child.kill()
        self._exit(STALLED_EXIT_CODE)


#: The stall watch of the entry point running in this process, if any.
_current = [None]


@contextlib.contextmanager
def waiting_for(owner):
    """Marks this process as waiting for process `owner` while the block
    runs: its part of a divided batch (`input/transport.py`), or
    `EVERY_PROCESS` in a collective (a step's, an exchange of batches)."""
    watch = _current[0]
    if watch is None:
        yield
        return
    watch.wait_for(owner)
    try:
        yield
    finally:
        watch.wait_for(None)
