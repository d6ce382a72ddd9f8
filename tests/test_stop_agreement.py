"""The stop agreement (`persistence/stop_agreement.py`): processes stop at
one step without a collective, even when a process waits for the others
inside a step.

Processes are threads here, one `StopAgreement` each over one shared store;
a `threading.Barrier` per step stands for the step's collective (no
thread finishes a step before every thread has started it), as gradients'
all-reduce holds real processes in step.
"""

import threading
import time

import pytest

from keras_parallel.persistence import stop_agreement
from keras_parallel.persistence.stop_agreement import LocalStore, StopAgreement


def train(
    num_processes, signals, steps=40, timeout=5.0, store=None, agreement_timeout=None
):
    """Runs `num_processes` lockstep loops; `signals` maps rank -> the step
    during which it gets a signal. Returns each rank's stop step (None: it
    trained every step) and agreement. `agreement_timeout`: the agreements'
    wait for every step (default `timeout`, the steps' own)."""
    store = store or LocalStore()
    collective = threading.Barrier(num_processes, timeout=timeout)
    agreements = [
        StopAgreement(
            store, rank, num_processes, "fit-1", timeout=agreement_timeout or timeout
        )
        for rank in range(num_processes)
    ]
    stopped = [None] * num_processes
    errors = []

    def loop(rank):
        agreement = agreements[rank]
        agreement.start()
        signalled = None
        try:
            for step in range(steps):
                collective.wait()  # The step's all-reduce.
                if signals.get(rank) == step:
                    signalled = "SIGTERM"
                time.sleep(0.002 * (rank + 1))  # Processes at their own pace.
                if agreement.should_stop(step, signalled):
                    stopped[rank] = step
                    return
        except Exception as error:
            errors.append((rank, error))
            collective.abort()
        finally:
            agreement.close()

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(num_processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a process hung"
    assert not errors, errors
    return stopped, agreements


def test_one_process_stops_at_the_batch_end_after_its_signal():
    stopped, agreements = train(1, {0: 7})
    assert stopped == [7]
    assert agreements[0].noticed == (0, "SIGTERM")


@pytest.mark.parametrize("num_processes, signalled_rank", [(2, 1), (2, 0), (4, 2)])
def test_every_process_stops_at_one_step_when_one_got_the_signal(
    num_processes, signalled_rank
):
    stopped, agreements = train(num_processes, {signalled_rank: 10})
    assert stopped[0] is not None
    assert len(set(stopped)) == 1, stopped
    # Right after the signal: at most one step later than the signalled
    # process's next batch end (others may have answered that one).
    assert 10 <= stopped[0] <= 11, stopped
    assert {a.noticed for a in agreements} == {(signalled_rank, "SIGTERM")}


def test_signals_to_several_processes_at_different_steps_give_one_stop():
    stopped, _ = train(3, {0: 12, 1: 5, 2: 20})
    assert len(set(stopped)) == 1 and stopped[0] is not None, stopped
    assert stopped[0] <= 7, stopped


def test_a_process_that_never_answers_sets_no_stop_and_hangs_nothing():
    # Rank 1 is gone (no agreement of its own): rank 0 waits `timeout`
    # for its step, then trains on, with the failure recorded.
    store = LocalStore()
    agreement = StopAgreement(store, 0, 2, "fit-1", timeout=0.5)
    agreement.start()
    start = time.monotonic()
    try:
        assert not agreement.should_stop(0, "SIGTERM")
        assert not agreement.should_stop(1, "SIGTERM")
    finally:
        agreement.close()
    assert time.monotonic() - start < 5
    assert agreement.stop_step is None
    assert "process 1 wrote no step within 0.5 s" in str(agreement.failure)


def test_entry_points_do_not_read_each_others_keys():
    store = LocalStore()
    stopped, _ = train(2, {1: 3}, store=store)
    assert stopped == [3, 3] or stopped == [4, 4], stopped
    # A later entry point with its own prefix sees no notice.
    later = StopAgreement(store, 0, 1, "fit-2", timeout=1.0)
    assert not later.should_stop(0)
    assert later.stop_step is None


def test_without_the_watcher_a_signalled_process_waits_for_ever(monkeypatch):
    # What the watcher thread is for: the others' main threads are inside
    # the next step's collective, waiting for the signalled one, and only
    # their watchers can write their steps.
    monkeypatch.setattr(StopAgreement, "start", lambda self: None)
    # The agreement waits longer than the step: the step breaks first (with
    # both at 1 s, either could give up first on a busy machine).
    with pytest.raises(AssertionError, match="BrokenBarrierError"):
        train(2, {1: 3}, timeout=1.0, agreement_timeout=5.0)
    # The watcher looks within the steps' 5 s (train's timeout) otherwise.
    assert stop_agreement.POLL_S < 5.0


def test_on_the_runs_heartbeat_it_looks_every_other_tick():
    # The stall watch publishes on the other ticks: one request a second
    # per process in all.
    from keras_parallel.run.heartbeat import Heartbeat

    store, reads, ticks = LocalStore(), [], []
    store.try_get = lambda key, get=store.try_get: reads.append(key) or get(key)
    heartbeat = Heartbeat(interval=0.01)
    heartbeat.add(lambda: ticks.append(1) or True)
    agreement = StopAgreement(store, 0, 2, "fit-1", timeout=1.0)
    agreement.start(heartbeat)
    time.sleep(0.5)
    heartbeat.close()
    agreement.close()
    assert len(ticks) > 10
    assert abs(len(reads) - len(ticks) / 2) <= 1, (len(reads), len(ticks))


def test_a_forged_notice_is_refused_and_raised_in_the_training_thread():
    # Someone who reached the store writes a stop notice under the real key
    # without the run's secret: no process stops at an agreed step; each
    # fails at its next batch end, naming the key.
    from keras_parallel.messages.signed_store import SignedStore, UntrustedValueError

    raw = LocalStore()
    raw.set("keras_parallel/stop/fit-1/notice", "0:SIGTERM")
    agreement = StopAgreement(
        SignedStore(raw, b"secret", sender=1), 1, 2, "fit-1", timeout=5.0
    )
    assert agreement._poll() is False  # Refused: nothing more to look for.
    with pytest.raises(UntrustedValueError, match="stop/fit-1/notice"):
        agreement.should_stop(0)
    assert agreement.stop_step is None and agreement.noticed is None
