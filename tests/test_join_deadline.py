"""Mistakes in a cluster's environment end every process, naming the variable.

First the pieces of `cluster_environments/join_deadline.py` in this
process (the timeout's variable, the port check, the message of every
environment) and in a process of their own (the watchdog ends one that
waits too long, and leaves one that joined in time). Then, on the suite's
backend, two processes started as `srun` starts them
(`cluster_launchers.start_two`) with a mistake: a rank nobody started, a
rank given twice, rank 0's port held by another program. Each must end
every process within 60 s with an error that names the variable to fix,
where without the deadline they would wait for minutes (JAX, torch) or an
hour (TensorFlow).
"""

import os
import socket
import subprocess
import sys
import textwrap
import time

import keras
import pytest
from cluster_launchers import bare_env, exit_codes, free_port_run, start_two
from subprocesses import gone

from keras_parallel.cluster_environments import (
    ClusterEnvironmentError,
    KerasDistributionEnvironment,
    OpenMPIEnvironment,
    SlurmEnvironment,
    TorchElasticEnvironment,
    join_deadline,
)
from keras_parallel.cluster_environments.tf_config import TFConfigEnvironment

BACKEND = keras.backend.backend()
#: Short, for the tests' time: every end-to-end case here is a mistake,
#: in which no process may join, so no deadline is too short for it.
JOIN_TIMEOUT = "3"


def slurm(rank=0, **more):
    environ = {
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "73456",
    }
    environ.update(more)
    return SlurmEnvironment(environ)


def test_the_default_timeout_ends_a_mistake_within_a_minute():
    assert join_deadline.join_timeout_seconds({}) == 45.0
    assert (
        join_deadline.join_timeout_seconds({"KERAS_PARALLEL_JOIN_TIMEOUT": "600"})
        == 600
    )


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_wrong_timeout_is_named(value):
    with pytest.raises(ClusterEnvironmentError, match="KERAS_PARALLEL_JOIN_TIMEOUT"):
        join_deadline.join_timeout_seconds({"KERAS_PARALLEL_JOIN_TIMEOUT": value})


def test_a_taken_port_is_named_with_its_variables():
    port = free_port_run(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(ClusterEnvironmentError) as caught:
            join_deadline.check_port_free(slurm(), f"127.0.0.1:{port}")
    message = str(caught.value)
    assert f"port {port}, which is taken" in message
    assert "SLURM_JOB_ID (15000 + its last 4 digits)" in message
    assert "MASTER_PORT" in message and "SLURM_PROCID" in message
    # Free again: the check passes (and holds nothing).
    join_deadline.check_port_free(slurm(), f"127.0.0.1:{port}")
    join_deadline.check_port_free(slurm(), f"127.0.0.1:{port}")


def test_a_port_taken_while_the_runtime_bound_it_is_named():
    # Two processes of one rank both find the port free; the later one's
    # runtime then fails to bind with an error that names no variable.
    port = free_port_run(1)
    with socket.socket() as holder:
        with pytest.raises(ClusterEnvironmentError, match="which is taken") as caught:
            with join_deadline.port_checked(slurm(), f"127.0.0.1:{port}"):
                holder.bind(("127.0.0.1", port))
                holder.listen()
                raise RuntimeError("EADDRINUSE")
    assert "SLURM_PROCID" in str(caught.value)
    assert str(caught.value.__cause__) == "EADDRINUSE"


def test_a_runtime_failure_with_the_port_free_is_left_as_it_was():
    port = free_port_run(1)
    with pytest.raises(RuntimeError, match="^something else$"):
        with join_deadline.port_checked(slurm(), f"127.0.0.1:{port}"):
            raise RuntimeError("something else")


@pytest.mark.parametrize(
    "env, names",
    [
        (slurm(1), ["SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_JOB_ID"]),
        (
            OpenMPIEnvironment(
                {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
                | {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
            ),
            ["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "MASTER_PORT is unset"],
        ),
        (
            TorchElasticEnvironment(
                {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0"}
                | {"MASTER_PORT": "1234"}
            ),
            ["WORLD_SIZE", "RANK", "MASTER_PORT"],
        ),
        (
            KerasDistributionEnvironment(
                {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "h0:1234"}
                | {"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}
                | {"KERAS_DISTRIBUTION_PROCESS_ID": "1"}
            ),
            [
                "KERAS_DISTRIBUTION_NUM_PROCESSES",
                "KERAS_DISTRIBUTION_PROCESS_ID",
                "KERAS_DISTRIBUTION_JOB_ADDRESSES",
            ],
        ),
        (
            TFConfigEnvironment(
                {
                    "TF_CONFIG": '{"cluster": {"worker": ["h0:1234", "h1:1234"]}, '
                    '"task": {"type": "worker", "index": 1}}'
                }
            ),
            ["TF_CONFIG's cluster.worker lists 2", "TF_CONFIG's task.index"],
        ),
    ],
    ids=["slurm", "openmpi", "torchelastic", "keras", "tf_config"],
)
def test_the_message_names_each_environments_variables(env, names):
    message = join_deadline.join_failure_message(env, "h0:1234", 45.0)
    assert message.startswith(
        "keras_parallel: rank 1 of 2 did not meet the other processes"
    )
    assert "within 45 s (KERAS_PARALLEL_JOIN_TIMEOUT)" in message
    assert "rank 0 could listen on h0:1234" in message
    for name in names:
        assert name in message


def test_a_tf_config_in_the_process_environment_is_described(monkeypatch):
    """`os.environ`, unlike a dict, refuses to look up a variable named None."""
    config = '{"cluster": {"worker": ["h0:1", "h1:2"]}, "task": {"index": 1}}'
    monkeypatch.setenv("TF_CONFIG", config)
    env = TFConfigEnvironment()
    assert env.describe() == (
        "TF_CONFIG (world size 2, rank 1, local rank None, node rank None, "
        "main address h0:1)"
    )
    assert "TF_CONFIG's task.index from 0 to 1" in join_deadline.join_failure_message(
        env, "h0:1", 45.0
    )


def test_a_tf_config_index_outside_its_workers_is_named():
    config = '{"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"index": 2}}'
    env = TFConfigEnvironment({"TF_CONFIG": config})
    with pytest.raises(
        ClusterEnvironmentError, match=r"task.index must be in \[0, 2\)"
    ):
        env.global_rank()


def test_without_a_python_to_run_the_watchdog_the_join_warns_and_waits(
    monkeypatch,
):
    """A frozen application's `sys.executable` is itself: no watchdog then."""
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    with pytest.warns(UserWarning, match="cannot bound the wait"):
        with join_deadline.join_deadline(slurm(), "127.0.0.1:18456"):
            ran = True
    assert ran


# ------------------------------------------------- the watchdog, in a process
WAITER = textwrap.dedent(
    """
    import os, sys, time
    from keras_parallel.cluster_environments import SlurmEnvironment, join_deadline
    env = SlurmEnvironment()
    with join_deadline.join_deadline(env, "127.0.0.1:18456"):
        if sys.argv[1] == "crash":
            os.abort()  # As JAX's runtime does where its port is taken.
        if sys.argv[1] == "raise":
            raise RuntimeError("the runtime's own error")
        time.sleep(float(sys.argv[1]))
    print("joined", flush=True)
    time.sleep(float(sys.argv[2]))
    """
)


def run_waiter(tmp_path, wait_s, after_s):
    env = bare_env(KERAS_PARALLEL_JOIN_TIMEOUT="2", **slurm(0).environ)
    started = time.monotonic()
    # `tmp_path` in the command line: how `gone` finds a leftover.
    command = [sys.executable, "-c", WAITER, str(wait_s), str(after_s), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


@pytest.mark.timeout(120)
def test_a_process_that_waits_too_long_is_ended_saying_what_to_check(tmp_path):
    done, seconds = run_waiter(tmp_path, 30, 0)
    assert done.returncode == -9, done.stderr[-2000:]
    assert seconds < 20
    assert "joined" not in done.stdout
    assert "rank 0 of 2 did not meet the other processes of its slurm job" in (
        done.stderr
    )
    assert "SLURM_PROCID" in done.stderr and "SLURM_STEP_NUM_TASKS" in done.stderr
    assert not gone(str(tmp_path))


@pytest.mark.timeout(120)
def test_a_process_that_dies_inside_the_join_is_named_by_its_watchdog(tmp_path):
    done, _ = run_waiter(tmp_path, "crash", 0)
    assert done.returncode == -6, done.stderr[-2000:]
    assert "rank 0 of 2 ended while it joined the other processes" in done.stderr
    assert "its own SLURM_PROCID from 0 to 1" in done.stderr
    assert "did not meet" not in done.stderr
    assert not gone(str(tmp_path))


@pytest.mark.timeout(120)
def test_a_python_error_inside_the_join_is_left_to_say_itself(tmp_path):
    # The error names what it is; the watchdog adds no second story.
    done, _ = run_waiter(tmp_path, "raise", 0)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: the runtime's own error" in done.stderr
    assert "ended while it joined" not in done.stderr
    assert "did not meet" not in done.stderr


@pytest.mark.timeout(120)
def test_a_process_that_joined_in_time_is_left_alone(tmp_path):
    # Joined after 0.1 s, then it runs past the deadline: not ended.
    done, _ = run_waiter(tmp_path, 0.1, 3)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "joined" in done.stdout
    assert "did not meet" not in done.stderr
    assert "ended while it joined" not in done.stderr


# ------------------------------------------- mistakes, on the suite's backend
#: What the backend's processes need besides the launcher's variables.
BACKEND_VARIABLES = {
    "jax": {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    "torch": {},
    "tensorflow": {
        "KERAS_PARALLEL_DEVICES_PER_PROCESS": "2",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    },
}[BACKEND]
#: The ports from the main one that a group uses (TensorFlow: one per
#: worker after it), and the one rank 0 listens on.
PORTS = 3 if BACKEND == "tensorflow" else 1
RANK_0_PORT_OFFSET = 1 if BACKEND == "tensorflow" else 0


def start_with_mistake(out, ranks, port=None):
    started = time.monotonic()
    done = start_two(
        out,
        "srun",
        BACKEND,
        PORTS,
        ranks=ranks,
        port=port,
        timeout=90,
        KERAS_PARALLEL_JOIN_TIMEOUT=JOIN_TIMEOUT,
        **BACKEND_VARIABLES,
    )
    seconds = time.monotonic() - started
    assert seconds < 60, done.stderr[-3000:]
    assert all(code != 0 for code in exit_codes(done)), done.stderr[-3000:]
    assert not [name for name in os.listdir(out) if name.startswith("weights")]
    return done.stderr


@pytest.mark.timeout(180)
def test_a_rank_nobody_started_ends_the_others_naming_the_count_and_rank(tmp_path):
    stderr = start_with_mistake(tmp_path, ranks=(0,))
    assert "rank 0 of 2 did not meet the other processes of its slurm job" in stderr
    assert "all 2 processes were started (SLURM_STEP_NUM_TASKS=2)" in stderr
    assert "SLURM_PROCID from 0 to 1" in stderr


@pytest.mark.timeout(180)
def test_two_processes_of_one_rank_both_end_naming_the_rank(tmp_path):
    stderr = start_with_mistake(tmp_path, ranks=(0, 0))
    assert "SLURM_PROCID" in stderr
    # One finds the other's port taken at once (or, where JAX bound it
    # first, crashes and its watchdog says so), or both wait in vain.
    assert (
        "which is taken" in stderr
        or "ended while it joined" in stderr
        or stderr.count("did not meet") == 2
    ), stderr[-3000:]


@pytest.mark.timeout(180)
def test_a_taken_port_ends_every_process_naming_its_variable(tmp_path):
    port = free_port_run(PORTS)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + RANK_0_PORT_OFFSET))
        holder.listen()
        stderr = start_with_mistake(tmp_path, ranks=(0, 1), port=port)
    assert f"port {port + RANK_0_PORT_OFFSET}, which is taken" in stderr
    assert "SLURM_JOB_ID (15000 + its last 4 digits)" in stderr
    assert "set MASTER_PORT" in stderr or "MASTER_PORT to choose" in stderr
    # Rank 1 waited for rank 0 in vain, and said so.
    assert "rank 1 of 2 did not meet" in stderr
