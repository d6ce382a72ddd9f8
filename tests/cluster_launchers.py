"""Two local processes started as `srun` or `mpirun` start them: fakes.

No launcher of ours: one shell starts a script (`cluster_environment_script.py`
unless told) twice, rank 0 in the background and rank 1 in front, each with
the variables its cluster launcher sets (`slurm`, `openmpi`, `torchelastic`
give them per rank). The shell runs in a session of its own, killed whole (SIGKILL: JAX
catches SIGTERM) at the timeout; `start_two` fails if a process outlives it.
`bare_env` is the tests' environment with no launcher's variable, for a
process of one.
"""

import json
import os
import random
import socket
import sys

import numpy as np
import pytest
from subprocesses import checkout_env, gone, run_in_session

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 240
#: What the tests' own environment may hold of a launcher: none may leak in.
LAUNCHER_PREFIXES = ("SLURM_", "SLURMD_", "OMPI_", "KERAS_DISTRIBUTION_")
LAUNCHER_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "KERAS_PARALLEL_CLUSTER",
    "KERAS_PARALLEL_JOINED_PID",
)


def is_launcher_variable(name):
    """Whether `name` is a variable some launcher sets (or keras_parallel's
    cluster settings)."""
    return name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES


#: Task 1 of `srun -N 2 -n 2` (one task per node, step 0): its variables.
SLURM_TASK_1_OF_2_NODES = {
    "SLURM_NTASKS": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_JOB_ID": "123456",
}


_CHOOSER = random.SystemRandom()


def free_port_run(count):
    """A port in 15000-24999 with the `count - 1` after it free too.

    Chosen with the operating system's randomness: `random`'s shared
    generator is seeded by `keras.utils.set_random_seed`, and two test
    runs side by side (CI's lanes) chose the same ports in turn.
    """
    for _ in range(100):
        port = _CHOOSER.randrange(15000, 25000 - count)
        try:
            for offset in range(count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    pytest.skip("no free run of ports in 15000-24999")


def slurm(port):
    """`srun -n 2` on one node: the variables of each rank.

    A task of step 0 (`SLURM_STEP_ID`, `SLURM_STEP_NUM_TASKS`: srun's). The
    port is SLURM's derived one (`15000 + the last 4 digits of
    SLURM_JOB_ID`), so the job id is chosen to derive `port`.

    Returns:
        `(shared, per_rank)`: the variables both ranks have, and a function
        of the rank giving its own.
    """
    shared = {
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": f"7{port - 15000:04d}",
        "SLURM_JOB_NAME": "train",
    }
    return shared, lambda rank: {"SLURM_PROCID": rank, "SLURM_LOCALID": rank}


def openmpi(port):
    """`mpirun -n 2 -x MASTER_PORT=<port>` on one host: each rank's variables."""
    shared = {
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": str(port),
    }
    return shared, lambda rank: {
        "OMPI_COMM_WORLD_RANK": rank,
        "OMPI_COMM_WORLD_LOCAL_RANK": rank,
    }


def torchelastic(port):
    """A Kubeflow PyTorchJob of 2 replicas on one host (or `torchrun` without its agent).

    The variables its pods get: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    `MASTER_PORT`, and torchrun's local ones. JAX's coordinator takes
    `port + 1`.
    """
    shared = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return shared, lambda rank: {"RANK": rank, "LOCAL_RANK": rank}


LAUNCHERS = {"srun": slurm, "mpirun": openmpi, "torchelastic": torchelastic}


def bare_env(**variables):
    """`checkout_env()` without any launcher's variable, then `variables`."""
    env = {
        name: value
        for name, value in checkout_env().items()
        if not is_launcher_variable(name)
    }
    env.update({name: str(value) for name, value in variables.items()})
    return env


def start_two(out, launcher, backend, ports, timeout=TIMEOUT_S, **arguments):
    """Runs the script in two processes as `launcher` would; waits for both.

    Args:
        out, launcher, backend, ports, arguments: as `command_of_two`'s.
        timeout: seconds until every process is killed.

    Returns:
        The `subprocess.CompletedProcess` of the shell.

    Raises:
        subprocess.TimeoutExpired: past `timeout`, every process killed.
    """
    argv, env = command_of_two(out, launcher, backend, ports, **arguments)
    try:
        return run_in_session(argv, env, timeout)
    finally:
        assert not gone(str(out)), "a process outlived the test"


def command_of_two(
    out,
    launcher,
    backend,
    ports,
    joined=True,
    script="cluster_environment_script.py",
    args=(),
    ranks=(0, 1),
    port=None,
    **variables,
):
    """`(argv, env)` of a shell that starts the script in two processes as
    `launcher` would, each with its launcher's variables, as its children.

    Args:
        out: the directory the processes write to; the script's first
            argument (also how `gone` finds the processes).
        launcher: a key of `LAUNCHERS`.
        backend: `KERAS_BACKEND`.
        ports: how many consecutive ports must be free from the main port.
        joined: False runs each process through `without_cluster_join.py`
            (keras_parallel's joining removed): the red case.
        script: the script, in `tests/`.
        args: its arguments after `out`.
        ranks: the rank of each process to start, of a world of 2: a
            mistake leaves one out (`(0,)`) or gives one twice (`(0, 0)`).
        port: the main port; by default a free one (`ports` of them).
        variables: more variables for both processes.
    """
    port = free_port_run(ports) if port is None else port
    shared, per_rank = LAUNCHERS[launcher](port)
    env = bare_env(KERAS_BACKEND=backend, **variables)
    env.update(shared)
    script = os.path.join(HERE, script)
    run = [sys.executable]
    if not joined:
        run.append(os.path.join(HERE, "without_cluster_join.py"))
    run = " ".join([*run, script, str(out), *map(str, args)])

    def assign(rank):
        return " ".join(f"{name}={value}" for name, value in per_rank(rank).items())

    # Every process but the last in the background; exit codes in order.
    *background, last = ranks
    started = "".join(
        f"{assign(rank)} {run} & pid{i}=$!; " for i, rank in enumerate(background)
    )
    waited = "".join(f'wait "$pid{i}"; code{i}=$?; ' for i in range(len(background)))
    codes = [f"$code{i}" for i in range(len(background))] + ["$last"]
    command = (
        f"{started}{assign(last)} {run}; last=$?; {waited}"
        f'echo "exit codes: {" ".join(codes)}" >&2; '
        f"exit $(( {' | '.join(c[1:] for c in codes)} ))"
    )
    return ["bash", "-c", command], env


def exit_codes(result):
    """Each process's exit code, in `start_two`'s `ranks` order."""
    line = [x for x in result.stderr.splitlines() if x.startswith("exit codes: ")]
    assert line, result.stderr[-3000:]
    return [int(code) for code in line[-1].split()[2:]]


#: The environment each launcher's processes must be found in.
DETECTED = {"srun": "slurm", "mpirun": "openmpi", "torchelastic": "torchelastic"}


def assert_plan_names_the_cluster(infos, launcher):
    """Each process's plan names the environment its launcher sets, and its rank."""
    for rank, info in enumerate(infos):
        line = f"Cluster: {DETECTED[launcher]} (world size 2, rank {rank},"
        assert line in info["plan"], info["plan"]


def one_process_reference():
    """`cluster_environment_script`'s step on one device, from process 0's seed."""
    import cluster_environment_script as script

    model = script.build(seed=1, distributed=False)
    script.train(model)
    return model.get_weights()


def check_one_group(out, reference, devices, records_per_process=None):
    """Both processes hold `reference`'s weights (1e-5), the batch split `devices` ways.

    Args:
        out: the directory `cluster_environment_script` wrote to.
        reference: `one_process_reference()`.
        devices: the devices (processes, replicas) of the whole group.
        records_per_process: the steps' records each process must hold
            (TensorFlow: one per local replica); any where None.
    """
    from split_probe import assert_divided

    weights, infos = results(out)
    for rank in (0, 1):
        assert infos[rank]["devices"] == devices, infos[rank]
        records = [tuple(r) for r in infos[rank]["records"]]
        if records_per_process is not None:
            assert len(records) == records_per_process, records
        assert_divided(records, 64, devices)
        assert max_rel(weights[rank], reference) < 1e-5


def results(out):
    """Each process's weights and info, rank order."""
    weights, infos = [], []
    for rank in (0, 1):
        with np.load(os.path.join(out, f"weights{rank}.npz")) as f:
            weights.append([f[k] for k in sorted(f.files, key=lambda k: int(k[4:]))])
        with open(os.path.join(out, f"info{rank}.json")) as f:
            infos.append(json.load(f))
    return weights, infos


def max_rel(a_weights, b_weights):
    assert a_weights, "no weights to compare"
    assert len(a_weights) == len(b_weights), (len(a_weights), len(b_weights))
    return max(
        float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-12)
        for a, b in zip(a_weights, b_weights, strict=True)
    )
