"""The rules of the join at `import keras` (`keras_parallel.cluster_environments.join`).

No process is started and no runtime joined: the backend's join is
replaced by a fake, so these run on every backend. The joins themselves
run in `test_jax_cluster_environment.py` and
`test_tensorflow_cluster_environment.py`.
"""

import os
import sys

import pytest

from keras_parallel import keras_config
from keras_parallel.cluster_environments import join as cluster_join
from keras_parallel.errors import ClusterJoinError, UnsupportedKerasError

SLURM = {
    "SLURM_NTASKS": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_JOB_ID": "123456",
}


@pytest.fixture
def fresh(monkeypatch):
    """No earlier failure, no marker, no opt-out; the join and exit faked."""
    monkeypatch.setattr(cluster_join, "_failure", None)
    monkeypatch.delenv(cluster_join.JOINED_PID_VAR, raising=False)
    monkeypatch.delenv("KERAS_PARALLEL_CLUSTER", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    joins = []

    def fake_join():
        joins.append(os.getpid())
        return (1, 2)

    monkeypatch.setitem(cluster_join._JOINS, "jax", fake_join)
    return joins


def test_a_process_started_as_one_of_several_may_join(fresh):
    assert cluster_join.may_join(SLURM)
    assert cluster_join.may_join(
        dict(SLURM, KERAS_PARALLEL_JOINED_PID=str(os.getpid()))
    )


def test_a_multiprocessing_child_does_not_join(fresh, monkeypatch):
    """A spawn or forkserver worker inherits its parent's rank: it runs alone."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    assert not cluster_join.may_join(SLURM)
    assert cluster_join.join("jax") is None
    assert fresh == []


def test_a_child_of_a_joined_process_does_not_join(fresh):
    """Any subprocess (a data worker, a tool): the marker names its parent."""
    assert not cluster_join.may_join(dict(SLURM, KERAS_PARALLEL_JOINED_PID="1"))


def test_keras_parallel_cluster_off_joins_nothing(fresh, monkeypatch):
    monkeypatch.setenv("KERAS_PARALLEL_CLUSTER", "off")
    assert not cluster_join.may_join()
    assert cluster_join.join("jax") is None
    assert fresh == []


def test_a_join_replaces_the_excepthook_once(fresh):
    assert cluster_join.join("jax") == (1, 2)
    hook = sys.excepthook
    assert hook._keras_parallel_rank == 1
    cluster_join.install_excepthook(1, 2)
    assert sys.excepthook is hook


def test_the_excepthook_names_the_rank_and_exits_at_once(fresh, monkeypatch, capsys):
    printed, exits = [], []
    monkeypatch.setattr(sys, "excepthook", lambda *info: printed.append(info[1]))
    monkeypatch.setattr(os, "_exit", exits.append)
    cluster_join.install_excepthook(3, 4)
    error = RuntimeError("boom")
    sys.excepthook(RuntimeError, error, None)
    assert printed == [error]  # The previous hook printed the traceback.
    assert exits == [1]
    assert "keras_parallel: rank 3 of 4 raised" in capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("jax.distributed.initialize() must be called before ..."),
        UnsupportedKerasError("Keras 9.0 lacks keras.src.x"),
        ValueError("SLURM_PROCID must be in [0, 2)"),
    ],
)
def test_an_error_names_the_join_and_the_opt_out_and_comes_again(
    fresh, monkeypatch, error
):
    calls = []

    def failing_join():
        calls.append(1)
        raise error

    monkeypatch.setitem(cluster_join._JOINS, "jax", failing_join)
    with pytest.raises(ClusterJoinError) as info:
        cluster_join.join("jax")
    message = str(info.value)
    assert message.startswith("keras_parallel's cluster join failed while Keras")
    assert f"Received: {type(error).__name__}: {error}" in message
    assert "KERAS_PARALLEL_CLUSTER=off" in message
    assert info.value.__cause__ is error
    # A second entry fails the same way, without trying again.
    with pytest.raises(ClusterJoinError) as again:
        cluster_join.join("jax")
    assert again.value is info.value
    assert calls == [1]


def test_a_failed_callback_waits_for_the_next_import_of_keras(monkeypatch):
    """`import keras` failed by the join leaves no Keras: the next must fail too."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))

    def failing():
        raise ClusterJoinError("no")

    finder = keras_config._AfterKerasImport(failing)
    sys.meta_path.insert(0, finder)
    with pytest.raises(ClusterJoinError):
        finder.loaded()
    assert sys.meta_path[0] is finder
    finder.callback = lambda: None
    finder.loaded()
    assert finder not in sys.meta_path
