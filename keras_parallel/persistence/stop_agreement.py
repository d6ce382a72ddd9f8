"""Every process agrees on the step at which to stop, without a collective.

A collective per batch would cost a round trip and make a peer's failure this
process's, so they agree through the runtime's key-value store, as JAX's
preemption sync manager does: 1. the signalled process writes a notice; 2. each
process, once it sees it, writes the last step it answered and waits for every
process's; 3. the stop step is the largest plus one (docs/checkpoints.md).
"""

import threading
import time

# The one-process store is the executor's (`Executor.key_value_store`).
from keras_parallel.backends.base import LocalStore  # noqa: F401
from keras_parallel.messages.signed_store import KeyAlreadySetError, UntrustedValueError
from keras_parallel.run.heartbeat import TICK_S, Heartbeat

#: Seconds between two looks for a notice: the run's heartbeat, every other
#: tick of it where the stall watch shares it, one request a second per
#: process in all (at 10 a second, 1,000 processes would send one
#: coordinator 10,000 requests a second). The processes still stop within a
#: step of each other: the others' steps wait for the signalled one.
POLL_S = TICK_S
#: Seconds between two looks for every process's step, once a notice is in.
ANSWER_POLL_S = 0.01


class StopAgreement:
    """The agreed stop step of one entry point's processes.

    Args:
        store: the processes' key-value store: `set(key, value)` and
            `try_get(key)` (the value, or None), values strings.
        rank: this process's index.
        num_processes: how many processes agree.
        prefix: the keys' prefix, one per entry point (the processes' same
            count of entry points so far: keys of an earlier run are never
            read).
        timeout: seconds to wait for every process's step.

    Example:

    ```python
    agreement = StopAgreement(LocalStore(), 0, 1, "fit-1", timeout=20.0)
    agreement.start()
    agreement.should_stop(step=0, signalled="SIGTERM")  # True: one process
    agreement.close()
    ```
    """

    def __init__(self, store, rank, num_processes, prefix, timeout):
        self.store = store
        self.rank = rank
        self.num_processes = num_processes
        self.prefix = prefix
        self.timeout = timeout
        #: The agreed stop step, once known.
        self.stop_step = None
        #: Who got the signal, from the notice: `(rank, signal name)`.
        self.noticed = None
        #: Why no stop step could be agreed, if so.
        self.failure = None
        #: A notice the store refused (`signed_store.UntrustedValueError`):
        #: raised at the next `should_stop`.
        self.refused = None
        # Held while a step is answered and while steps 2 and 3 run: the main
        # thread answers no other step until the stop step is set.
        self._lock = threading.Lock()
        self._answered = -1
        self._agreed = False
        self._closed = threading.Event()
        self._heartbeat = None
        self._own_heartbeat = False
        self._polls = 0

    def _key(self, name):
        return f"keras_parallel/stop/{self.prefix}/{name}"

    def start(self, heartbeat=None):
        """Looks for a notice at every tick of `heartbeat` (several processes
        only).

        Args:
            heartbeat: the run's `Heartbeat`, shared with the stall watch;
                None: a heartbeat of its own, started and closed here.
        """
        if self.num_processes == 1:
            return
        if heartbeat is None:
            heartbeat = Heartbeat(POLL_S, name="keras_parallel-stop-watch")
            self._own_heartbeat = True
        self._heartbeat = heartbeat
        heartbeat.add(self._poll)
        heartbeat.start()

    def close(self):
        """Looks for no more notices; closes a heartbeat of its own."""
        self._closed.set()
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None and self._own_heartbeat:
            heartbeat.close()

    def should_stop(self, step, signalled=None):
        """Whether every process stops after `step`; call at every batch end.

        Args:
            step: this batch end's number within the entry point (0, 1, ...).
            signalled: the name of the signal this process got, if any.

        Returns:
            True at the agreed stop step (the same on every process).
        """
        with self._lock:
            if self.refused is not None:
                # A notice without the run's tag: refused where it was read,
                # raised here, in the training thread.
                raise self.refused
            if signalled and not self._agreed:
                self.store_notice(signalled)
                self._agree()
            self._answered = step
            return self.stop_step == step

    def store_notice(self, signal_name):
        """Writes the notice that this process got `signal_name`."""
        if self.store.try_get(self._key("notice")) is None:
            try:
                self.store.set(self._key("notice"), f"{self.rank}:{signal_name}")
            except KeyAlreadySetError:
                pass  # Another process's notice came first: one is enough.

    def _poll(self):
        """One tick: a notice? Returns False once there is no more to do. On
        the run's heartbeat, every other tick: the stall watch publishes on
        the others, so that each process sends one request a second."""
        if self._closed.is_set():
            return False
        self._polls += 1
        if not self._own_heartbeat and self._polls % 2 == 0:
            return True
        # The store gone (the run ending) raises: the heartbeat drops it.
        try:
            notice = self.store.try_get(self._key("notice"))
        except UntrustedValueError as error:
            self.refused = error  # A forged stop: nothing of it is used.
            return False
        if notice is None:
            return True
        with self._lock:
            if not self._agreed:
                self._agree()
        return False

    def _agree(self):
        """Steps 2 and 3 of the protocol; called holding the lock, once."""
        self._agreed = True
        try:
            self.store.set(self._key(f"step/{self.rank}"), str(self._answered))
            steps = [
                int(self._wait_for(self._key(f"step/{rank}"), rank))
                for rank in range(self.num_processes)
            ]
            notice = self.store.try_get(self._key("notice")) or ":"
        except Exception as error:  # A process that died, a store gone.
            self.failure = error
            return
        # No process has answered it yet, and every process reaches it: their
        # steps' collectives keep them in step.
        self.stop_step = max(steps) + 1
        rank, _, name = notice.partition(":")
        self.noticed = (int(rank) if rank.isdigit() else None, name or None)

    def _wait_for(self, key, rank):
        deadline = time.monotonic() + self.timeout
        while True:
            value = self.store.try_get(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"process {rank} wrote no step within {self.timeout:g} s"
                )
            time.sleep(ANSWER_POLL_S)
