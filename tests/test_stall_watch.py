"""The stall watch (`run/stall_watch.py`): a process that stops moving while the
others wait is named with its stack; every process alike slow is not.

Processes are `StallWatch`es over one store here, on one fake clock, ticked
as the run's heartbeat ticks them: each simulated second, the processes
that move record a step of Keras's loop, then every watch ticks. Their
`os._exit` is a list of the codes they exited with. The multi-process
tests (`test_stall_across_processes.py`) run it in real launches.
"""

import json

import pytest

from keras_parallel.backends.base import LocalStore
from keras_parallel.run import stall_positions, stall_settings, stall_watch
from keras_parallel.run.stall_positions import decode_record
from keras_parallel.run.stall_watch import STALLED_EXIT_CODE, StallWatch

TIMEOUT = 30.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def processes(n, launched=True, timeout=TIMEOUT):
    store, clock, exits = LocalStore(), Clock(), {}
    watches = []
    for rank in range(n):

        def exit_(code, rank=rank):
            exits[rank] = code

        watches.append(
            StallWatch(
                store,
                rank,
                n,
                "fit-1",
                timeout,
                launched=launched,
                clock=clock,
                exit=exit_,
                sleep=lambda seconds: None,
            )
        )
    return store, clock, exits, watches


def run(watches, clock, seconds, moving):
    """`seconds` simulated seconds; `moving(rank, second)`: whether that
    process finishes a step (a batch's begin and end) in that second."""
    for second in range(seconds):
        clock.now += 1.0
        for watch in watches:
            if not watch._ended and moving(watch.rank, second):
                watch.moved("on_train_batch_begin", epoch=1, batch=second)
                watch.moved("on_train_batch_end", epoch=1, batch=second)
        for watch in watches:
            if not watch._ended:
                watch.tick()


def test_a_process_asleep_is_named_with_its_stack_and_every_process_ends(capsys):
    store, clock, exits, watches = processes(3)
    # Process 1 stops after 5 steps (asleep in a callback); the others take
    # one step more and wait in its collective.
    run(
        watches,
        clock,
        60,
        lambda rank, second: second < 5 or (rank != 1 and second == 5),
    )
    assert exits == {0: STALLED_EXIT_CODE, 1: STALLED_EXIT_CODE, 2: STALLED_EXIT_CODE}
    report = capsys.readouterr().err
    first = report.splitlines()[0]
    assert first.startswith("keras_parallel: process 1 (host "), first
    assert "stalled after training batch 4 of epoch 1 ended" in first
    assert "exit code 77" in first and "run the same command to resume" in first
    # Its stack, every thread (here: the test's own).
    assert "Process 1's stack, every thread:" in report
    assert "test_a_process_asleep_is_named" in report
    # The others' positions and where they wait.
    assert "process 0 (host " in report and "process 2 (host " in report
    assert "after training batch 5 of epoch 1 ended; waits in " in report
    # One report (through the launcher): no line from the others.
    assert report.count("stalled after") == 1
    assert "ends: process 1 stalled" not in report


def test_a_process_making_its_part_of_a_divided_batch_is_named(capsys):
    # A PyDataset's batches made round-robin: process 1 is asleep in
    # `__getitem__`; process 0, at the same step of Keras's loop, waits for
    # its part (`input/transport.py` marks it).
    _, clock, exits, watches = processes(2)
    run(watches, clock, 4, lambda rank, second: True)
    watches[0].wait_for(1)
    run(watches, clock, 60, lambda rank, second: False)
    assert exits == {0: STALLED_EXIT_CODE, 1: STALLED_EXIT_CODE}
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("keras_parallel: process 1 (host "), first


def test_a_first_compile_that_ends_later_on_one_process_is_not_a_stall():
    # Busy cores: both processes compile their first step; process 1's
    # compile ends 25 s before process 0's, then it waits for process 0's
    # part of the batch. Process 0 has not moved for longer than the
    # timeout, but no one has waited for it that long: slow, not stalled.
    _, clock, exits, watches = processes(2)
    run(watches, clock, 4, lambda rank, second: True)
    run(watches, clock, int(TIMEOUT) - 10, lambda rank, second: False)
    watches[1].wait_for(0)
    run(watches, clock, 25, lambda rank, second: False)
    watches[1].wait_for(None)
    run(watches, clock, 20, lambda rank, second: True)
    assert exits == {}


class FirstValueStore(LocalStore):
    """Keeps a key's first value, as TensorFlow's coordination service does;
    `delete` forgets it."""

    def set(self, key, value):
        self._values.setdefault(key, value)

    def delete(self, key):
        self._values.pop(key, None)


def test_on_a_store_that_keeps_first_values_positions_still_move(capsys):
    store, clock, exits = FirstValueStore(), Clock(), {}
    watches = [
        StallWatch(
            store,
            rank,
            2,
            "fit-1",
            TIMEOUT,
            clock=clock,
            exit=lambda code, rank=rank: exits.setdefault(rank, code),
            sleep=lambda seconds: None,
        )
        for rank in range(2)
    ]
    # Both asleep alike for longer than the timeout, then process 1 stalls.
    run(watches, clock, 10, lambda rank, second: True)
    run(watches, clock, 2 * int(TIMEOUT), lambda rank, second: False)
    assert exits == {}
    run(
        watches, clock, 60, lambda rank, second: second < 5 or rank == 0 and second == 5
    )
    assert exits == {0: STALLED_EXIT_CODE, 1: STALLED_EXIT_CODE}
    assert capsys.readouterr().err.startswith("keras_parallel: process 1 (host ")


def test_a_forged_value_is_refused_and_the_watch_goes_on(capsys):
    # Someone who reached the store writes a report without the run's tag
    # (one that says process 0 stalled, which would end the waiting
    # processes before the stalled one's own report): refused and said, not
    # used, the watch goes on, and process 1's real stall is named.
    from keras_parallel.messages.signed_store import SignedStore

    store, clock, exits, watches = processes(3)
    for watch in watches:
        watch.store = SignedStore(store, b"the run's secret", watch.rank)
    store.set("keras_parallel/stall/fit-1/reported", "0")
    run(
        watches,
        clock,
        60,
        lambda rank, second: second < 5 or (rank != 1 and second == 5),
    )
    err = capsys.readouterr().err
    assert exits == {0: STALLED_EXIT_CODE, 1: STALLED_EXIT_CODE, 2: STALLED_EXIT_CODE}
    assert "stall watch refused a value of the run's store" in err, err
    assert "keras_parallel/stall/fit-1/reported" in err
    first = next(line for line in err.splitlines() if "stalled after" in line)
    assert first.startswith("keras_parallel: process 1 (host "), first


def test_a_process_that_published_nothing_is_not_named():
    _, clock, exits, watches = processes(2)
    silent = watches[1]
    silent.tick = lambda: True  # Never publishes (its store is elsewhere).
    run(watches, clock, 3 * int(TIMEOUT), lambda rank, second: rank == 0 and second < 3)
    assert exits == {}


def test_positions_name_who_is_behind():
    stalled = stall_positions.stalled_processes
    at = {"moves": 8, "waited": 1}
    assert stalled({0: at, 1: {"moves": 7}, 2: at}) == [1]
    assert stalled({0: at, 1: at}) == []
    # Ahead, but not yet for the timeout: no one is named.
    assert stalled({0: {"moves": 8}, 1: {"moves": 7}}) == []
    waits = {"moves": 8, "waits_for": 2, "waited": 1}
    assert stalled({0: waits, 1: waits, 2: at}) == [2]
    # Waiting, but not yet for the timeout: no one is named.
    assert stalled({0: {"moves": 8, "waits_for": 1}, 1: at}) == []
    # In a collective of every process (a step's, an exchange of batches):
    # those not in it are named.
    every = {"moves": 8, "waits_for": stall_positions.EVERY_PROCESS, "waited": 1}
    assert stalled({0: every, 1: at, 2: every}) == [1]
    # Two processes waiting for each other's parts: neither is named.
    each_other = {0: dict(waits, waits_for=1), 1: dict(waits, waits_for=0)}
    assert stalled(each_other) == []


def test_without_the_launcher_each_waiting_process_points_to_the_report(capsys):
    _, clock, exits, watches = processes(2, launched=False)
    run(
        watches, clock, 60, lambda rank, second: second < 3 or rank == 0 and second == 3
    )
    assert exits == {0: STALLED_EXIT_CODE, 1: STALLED_EXIT_CODE}
    err = capsys.readouterr().err
    assert "keras_parallel: process 0 ends: process 1 stalled" in err


def test_it_fires_after_the_timeout_not_before():
    _, clock, exits, watches = processes(2)
    run(watches, clock, int(TIMEOUT) - 2, lambda rank, second: second < 1 or rank == 0)
    # Process 1 stopped at second 1, process 0 moves on: not yet.
    assert exits == {}
    run(watches, clock, 40, lambda rank, second: False)
    assert set(exits) == {0, 1}


def test_every_process_alike_slow_is_not_a_stall_and_completes():
    store, clock, exits, watches = processes(4)
    # A first compile: no process moves for four timeouts, then all train.
    run(watches, clock, 4 * int(TIMEOUT), lambda rank, second: False)
    run(watches, clock, 20, lambda rank, second: True)
    assert exits == {}
    # And the looks at every position were spaced, not one a second.
    reads = []
    store.try_get = lambda key, get=store.try_get: reads.append(key) or get(key)
    run(watches, clock, 2 * int(TIMEOUT), lambda rank, second: False)
    looks = sum(key.endswith("/position/1") for key in reads)
    assert looks <= 3 * 2 * int(TIMEOUT) / stall_watch.LOOK_EVERY_S, looks


def test_a_slow_process_that_keeps_moving_is_not_a_stall():
    _, clock, exits, watches = processes(2)
    # Process 1 takes a step every 5 s, process 0 waits for it each time.
    run(watches, clock, 5 * int(TIMEOUT), lambda rank, second: second % 5 == 0)
    assert exits == {}


def test_a_stalled_process_whose_watch_stops_is_named_by_the_others(capsys):
    _, clock, exits, watches = processes(2)
    run(watches, clock, 4, lambda rank, second: True)
    asleep = watches[1]
    asleep.tick = lambda: True  # Its thread runs no more (the GIL held).
    run(watches, clock, 120, lambda rank, second: rank == 0 and second == 0)
    assert exits == {0: STALLED_EXIT_CODE}
    err = capsys.readouterr().err
    assert err.startswith("keras_parallel: process 1 (host ")
    assert "stack could not be read" in err


def test_the_heartbeat_sends_about_one_request_a_second():
    store, clock, _, watches = processes(2)
    sets = []
    store.set = lambda key, value, put=store.set: sets.append(key) or put(key, value)
    # A step every tick (a fast run): one position every other second each.
    run(watches, clock, 20, lambda rank, second: True)
    per_process = sum(key.endswith("/position/0") for key in sets)
    assert per_process == 10, sets


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps([1, 2]),
        json.dumps({"moves": "3"}),
        json.dumps({"moves": 3, "pad": "x" * 5000}),
        None,
    ],
)
def test_what_another_process_wrote_is_refused_unless_a_record(text):
    assert decode_record(text) is None


def test_a_record_keeps_only_known_keys_of_their_kind():
    record = decode_record(json.dumps({"moves": 4, "epoch": "1", "pid": 7, "x": 1}))
    assert record == {"moves": 4, "pid": 7}


@pytest.mark.parametrize(
    "value, expected",
    [("", stall_settings.DEFAULT_STALL_TIMEOUT_S), ("0", None), ("12.5", 12.5)],
)
def test_the_timeout_from_the_environment(value, expected):
    assert (
        stall_settings.stall_timeout({"KERAS_PARALLEL_STALL_TIMEOUT": value})
        == expected
    )


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_timeout_names_the_variable_and_the_fix(value):
    with pytest.raises(
        ValueError, match="KERAS_PARALLEL_STALL_TIMEOUT must be a number"
    ):
        stall_settings.stall_timeout({"KERAS_PARALLEL_STALL_TIMEOUT": value})


def test_the_launchers_option_sets_the_variable_and_leaves_the_scripts_own(
    monkeypatch,
):
    monkeypatch.delenv("KERAS_PARALLEL_STALL_TIMEOUT", raising=False)
    rest = stall_settings.take_stall_timeout_option(
        [
            "--nproc-per-node",
            "2",
            "--stall-timeout",
            "30",
            "train.py",
            "--stall-timeout",
            "5",
        ]
    )
    assert rest == ["--nproc-per-node", "2", "train.py", "--stall-timeout", "5"]
    import os

    assert os.environ["KERAS_PARALLEL_STALL_TIMEOUT"] == "30"
    with pytest.raises(ValueError, match="--stall-timeout must be a number"):
        stall_settings.take_stall_timeout_option(["--stall-timeout=later", "train.py"])


def test_the_launchers_variable_is_the_one_it_sets():
    from keras_parallel.launcher import parent_death

    assert stall_settings.LAUNCHED_VARIABLE == parent_death.LAUNCHER_PID_ENV
