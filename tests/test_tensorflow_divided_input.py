"""Each TensorFlow worker prepares only its share of the input.

2 workers x 2 logical CPU devices (one 4-replica
`MultiWorkerMirroredStrategy`) fit, validate, evaluate and predict through
arrays, a torch `DataLoader` over a map-style dataset (shuffled, each
worker seeding torch its own way), a `PyDataset` (shuffled) and a
generator: the rows each worker's pipeline prepared are about half of one
device's, and the weights, History, evaluation and predictions equal one
device's, the split proven by the rows each replica's step received.
"""

import json
import os
import pickle
import sys
import time

import divided_input_workers as workers
import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow workers (tox -e tensorflow)",
)

from subprocesses import checkout_env, run_in_session, running  # noqa: E402

try:
    import torch  # noqa: F401

    HAS_TORCH = True
except ImportError:
    HAS_TORCH = False

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {
    "arrays": dict(kind="arrays"),
    "pydataset": dict(kind="pydataset"),
    "generator": dict(kind="generator"),
    "tfdata": dict(kind="tfdata"),
}
if HAS_TORCH:
    CASES["dataloader"] = dict(kind="dataloader")
TIMEOUT_S = 300
#: One epoch's global batches, then its validation's (301 rows).
TRAIN = [64] * 15 + [43]
VALIDATION = [64] * 4 + [45]
VALIDATION_ROWS = 301


def launch(out, cases):
    command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
    command += ["--backend", "tensorflow", "--nproc-per-node", "2"]
    command += ["--allow-reachable-workers", "--devices-per-process", "2"]
    command += [os.path.join(HERE, "divided_input_script.py"), str(out)]
    command.append(cases if isinstance(cases, str) else json.dumps(cases))
    return run_in_session(command, checkout_env(KERAS_BACKEND="tensorflow"), TIMEOUT_S)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("divided")
    names = list(CASES)
    result = launch(out, [CASES[name] for name in names])
    assert result.returncode == 0, result.stderr[-4000:]
    per_worker = []
    for worker in (0, 1):
        with open(os.path.join(out, f"results{worker}.pkl"), "rb") as f:
            per_worker.append(pickle.load(f))
    results = {name: [w[i] for w in per_worker] for i, name in enumerate(names)}
    results["stdout"] = result.stdout
    return results


@pytest.fixture(scope="module")
def one_device():
    return {
        name: workers.run(**dict(case, distributed=False))
        for name, case in CASES.items()
    }


def replica_rows(rows, replica, replicas=4):
    """A replica's rows of a batch a worker divided (`divided_input`)."""
    return rows * (replica + 1) // replicas - rows * replica // replicas


def worker_rows(rows, worker):
    """A worker's rows of a batch: its 2 replicas hold slices `worker` and
    `2 + worker` of 4 (replica `r` of worker `w`: slice `r * 2 + w`)."""
    return replica_rows(rows, worker) + replica_rows(rows, 2 + worker)


@pytest.mark.parametrize("name", list(CASES))
def test_two_workers_train_as_one_device(two_workers, one_device, name):
    reference = one_device[name]
    # History's `row_count`, a metric object summing rows, is the global
    # sum: a metric object's variables are moved under the strategy too.
    for result in two_workers[name]:
        workers.assert_trained_as_one_device(result, reference)
    # The split: every replica step of both workers computed at most a
    # quarter of a 64-row batch, and together they computed each row of
    # every epoch and its validation once.
    seen = [rows for result in two_workers[name] for _, rows in result["split"]]
    assert max(seen) == 16, seen
    assert sum(seen) == workers.EPOCHS * (workers.ROWS + VALIDATION_ROWS), seen


@pytest.mark.parametrize("name", list(CASES))
def test_each_worker_divides_its_input(two_workers, name):
    kinds = {
        "arrays": "arrays",
        "dataloader": "DataLoader",
        "pydataset": "PyDataset",
        "generator": "generator",
        "tfdata": "tf.data",
    }
    kind = kinds[CASES[name]["kind"]]
    for result in two_workers[name]:
        # Arrays: each worker slices its own copy (no Python work per row).
        assert result["divided"].get(kind, False) is (kind != "arrays")


def test_the_first_fit_says_how_its_input_is_divided(two_workers):
    out = two_workers["stdout"]
    assert "Input: PyDataset, batches made round-robin by 2 processes" in out
    assert "Input: generator, drawn by process 0 alone" in out
    assert "Input: arrays, read whole by each of 2 processes" in out
    assert "Input: tf.data, each of 2 processes maps only its rows" in out
    if HAS_TORCH:
        assert "Input: DataLoader, each of 2 processes loads its rows" in out


@pytest.mark.skipif(not HAS_TORCH, reason="a torch DataLoader needs torch")
def test_each_worker_loads_its_rows_of_every_batch(two_workers, one_device):
    alone = one_device["dataloader"]["loaded"]
    batches = TRAIN + VALIDATION
    # The one device also loads the 2 batches Keras reads for the element
    # spec, once per loader.
    assert alone == 2 * sum(batches) + 2 * 64 + 2 * 64
    for worker, result in enumerate(two_workers["dataloader"]):
        share = sum(worker_rows(b, worker) for b in batches)
        assert result["loaded"] == 2 * share + 2 * 64 + 2 * 64
        assert result["loaded"] <= alone / 2 + 4 * 64


def test_each_worker_makes_half_a_pydatasets_batches(two_workers, one_device):
    alone = one_device["pydataset"]["loaded"]
    assert alone == 2 * 64 + 2 * 1003  # The spec's 2 batches, then 2 epochs.
    made = [r["loaded"] for r in two_workers["pydataset"]]
    for worker_made in made:
        assert worker_made <= 2 * 64 + 1003 + 64, made
    assert sum(made) == 2 * 2 * 64 + 2 * 1003  # Each batch made once.


def test_one_worker_draws_the_generator(two_workers, one_device):
    alone = one_device["generator"]["loaded"]
    drawn = [r["loaded"] for r in two_workers["generator"]]
    # Worker 1 draws only the 2 batches Keras peeks when fit starts; worker
    # 0 draws the epochs once, its replicas' prefetch a few batches further
    # ahead than one device's (trained on in the next epoch; after the last
    # epoch, drawn and dropped): 2 usually, 3 seen once. Drawn by every
    # worker, worker 1's count would be worker 0's.
    assert drawn[1] == 2 * 64, (drawn, alone)
    assert alone <= drawn[0] <= alone + 4 * 64, (drawn, alone)


def test_each_worker_maps_its_rows_of_a_tf_data_pipeline(two_workers, one_device):
    alone = one_device["tfdata"]["loaded"]
    batches = TRAIN + VALIDATION
    # Beyond its rows, each abandoned iterator (Keras's first look at the
    # data) may map what `prefetch(2)` and the map in progress hold: the
    # torch CI run saw 3.5 batches in all, so allow 6.
    slack = 6 * 64
    assert 2 * sum(batches) <= alone <= 2 * sum(batches) + slack
    for worker, result in enumerate(two_workers["tfdata"]):
        share = sum(worker_rows(b, worker) for b in batches)
        # Its replicas' rows of every batch (at most 1688 with the slack,
        # where a worker mapping every row maps at least 2608).
        assert 2 * share <= result["loaded"] <= 2 * share + slack


def test_a_worker_whose_pipeline_raises_is_the_one_reported(tmp_path):
    start = time.monotonic()
    result = launch(tmp_path, "fail")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "batch 3 could not be decoded" in result.stderr
    assert "worker 1 failed with exit code 1" in result.stderr
    assert time.monotonic() - start < 120
    assert running(str(tmp_path)) == []


def test_a_crafted_batch_under_a_real_key_is_refused_and_nothing_runs(tmp_path):
    # Any host that reaches the coordination service can write a key: a
    # value without the run's tag is refused before it is decoded (and
    # what is decoded is data, never unpickled: tests/test_wire.py).
    workers.assert_crafted_batch_refused(
        launch(tmp_path, "crafted"), tmp_path, "worker"
    )
    assert running(str(tmp_path)) == []


@pytest.mark.parametrize(
    "name", [n for n in CASES if n not in ("arrays", "pydataset_workers")]
)
def test_evaluate_and_predict_divide_their_input_too(name, two_workers, one_device):
    # Their results equal one device's: test_two_*_train_as_one_*.
    workers.assert_divided_after_fit(
        two_workers[name], one_device[name], CASES[name]["kind"]
    )


class _EmptyStore:
    """A key-value store whose other workers never hand anything over."""

    def set(self, key, value):
        pass

    def try_get(self, key):
        return None

    def delete(self, key):
        pass


class _TwoWorkers:
    num_workers, worker_index, num_replicas_in_sync = 2, 1, 2


def test_a_reader_waiting_for_a_worker_gone_gives_up_when_the_entry_point_ends():
    # Preempted (or failed) mid-epoch, the other worker is gone while this
    # one's prefetch waits for its rows; deleting the iterator at exit
    # would wait for that reader for ever (seen: a hang in 1 of 20 runs of
    # test_cluster_preemption). `close` at the entry point's end ends it.
    import threading

    from keras_parallel.backends.tensorflow.divided_input import DividedInput

    divided = DividedInput(_TwoWorkers(), _EmptyStore())
    reader = divided._generator_batches(adapter=None, run=divided._run())
    taken = []
    thread = threading.Thread(target=lambda: taken.extend(reader), daemon=True)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive()  # Waiting for worker 0's first batch.
    start = time.monotonic()
    divided.close()
    thread.join(timeout=5)
    assert not thread.is_alive(), "the reader still waits after close()"
    assert time.monotonic() - start < 1
    assert taken == []  # It ended the run; it made up no batch.
    # A run of the next entry point waits again, until its own close.
    later = divided._generator_batches(adapter=None, run=divided._run())
    thread = threading.Thread(target=lambda: taken.extend(later), daemon=True)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive()
    divided.close()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_worker_exits_while_an_abandoned_iterator_still_reads():
    # A preempted worker's Keras iterator, in a reference cycle, was deleted
    # by the interpreter's final collection while its thread read the
    # input: the exit hung (2 of 35 preempted runs). Dividing the input
    # registers a collection before exit, while threads still run Python.
    script = os.path.join(HERE, "tf_exit_script.py")
    env = checkout_env(KERAS_BACKEND="tensorflow")
    done = run_in_session([sys.executable, script, "divided"], env, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exiting" in done.stdout
