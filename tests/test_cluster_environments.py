"""The cluster environment detected from a process's variables.

Each launcher (`srun`, `mpirun`, torchrun, Keras's own variables) is faked
with monkeypatched variables; nothing is started. Every wrong value must
raise an error naming the variable to fix.
"""

import json
import os
import socket
import warnings

import pytest
from cluster_launchers import is_launcher_variable

from keras_parallel import bug_report
from keras_parallel import cluster_environments as ce


@pytest.fixture(autouse=True)
def bare(monkeypatch):
    """A bare machine: no launcher's variable is set."""
    for name in list(os.environ):
        if is_launcher_variable(name):
            monkeypatch.delenv(name)
    return monkeypatch


def setenv(monkeypatch, **variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, str(value))


#: A task of `srun -n 4` (step 0), on the second of two nodes.
SLURM = dict(
    SLURM_NTASKS=4,
    SLURM_STEP_ID=0,
    SLURM_STEP_NUM_TASKS=4,
    SLURM_PROCID=2,
    SLURM_LOCALID=0,
    SLURM_NODEID=1,
    SLURM_STEP_NODELIST="node[01-02]",
    SLURM_STEP_TASKS_PER_NODE="2(x2)",
    SLURM_JOB_ID=123456,
    SLURM_JOB_NAME="train",
)
OPENMPI = dict(
    OMPI_COMM_WORLD_SIZE=4,
    OMPI_COMM_WORLD_RANK=3,
    OMPI_COMM_WORLD_LOCAL_RANK=3,
    OMPI_COMM_WORLD_LOCAL_SIZE=4,
)
TORCHELASTIC = dict(
    RANK=1,
    WORLD_SIZE=2,
    LOCAL_RANK=1,
    LOCAL_WORLD_SIZE=2,
    GROUP_RANK=0,
    MASTER_ADDR="10.0.0.5",
    MASTER_PORT=29400,
)
KERAS = dict(
    KERAS_DISTRIBUTION_JOB_ADDRESSES="10.0.0.1:1234,10.0.0.1:1235,10.0.0.2:1234",
    KERAS_DISTRIBUTION_NUM_PROCESSES=3,
    KERAS_DISTRIBUTION_PROCESS_ID=1,
)


def values(env):
    return (
        env.name,
        env.world_size(),
        env.global_rank(),
        env.local_rank(),
        env.node_rank(),
        env.main_address(),
        env.main_port(),
    )


def test_a_bare_machine_has_no_environment():
    assert ce.detect_cluster_environment() is None
    assert ce.describe_environment() == (
        "none (a bare machine: use keras-parallel launch)"
    )


def test_slurm_is_detected_with_its_values(bare):
    setenv(bare, **SLURM)
    env = ce.detect_cluster_environment()
    assert isinstance(env, ce.SlurmEnvironment)
    # Port: Lightning's 15000 + the job id's last 4 digits (3456).
    assert values(env) == ("slurm", 4, 2, 0, 1, "node01", 18456)
    assert env.validate() is env


#: What the batch script of `sbatch --ntasks=4` (or a `salloc -n 4` shell)
#: holds: the allocation's task count, no srun step of its own.
SBATCH = dict(
    SLURM_NTASKS=4,
    SLURM_PROCID=0,
    SLURM_LOCALID=0,
    SLURM_NODEID=0,
    SLURM_JOB_NODELIST="node[01-02]",
    SLURM_TASKS_PER_NODE="2(x2)",
    SLURM_JOB_ID=123456,
    SLURM_JOB_NAME="train",
)


@pytest.fixture
def warn_again(monkeypatch):
    """The not-started-by-srun warning may come again (it comes once a process)."""
    from keras_parallel.cluster_environments import slurm

    monkeypatch.setattr(slurm, "_warned", False)


# The batch step: no SLURM_STEP_ID (SLURM's usual), or SLURM_BATCH_SCRIPT's
# id (4294967291 since SLURM 20.11, 4294967294 before); a salloc shell: none,
# or the interactive step's (4294967290); the extern step: 4294967292.
@pytest.mark.parametrize(
    "step_id", [None, "4294967291", "4294967294", "4294967290", "4294967292", "batch"]
)
def test_an_sbatch_script_or_salloc_shell_is_one_process_and_warns_once(
    bare, warn_again, step_id
):
    environ = dict(SBATCH, SLURM_STEP_NUM_TASKS=4) if step_id else dict(SBATCH)
    if step_id:
        environ["SLURM_STEP_ID"] = step_id
    setenv(bare, **environ)
    with pytest.warns(ce.NotStartedBySrunWarning) as warned:
        assert ce.detect_cluster_environment() is None
    message = str(warned[0].message)
    assert "SLURM_NTASKS=4" in message and "srun python train.py" in message
    assert f"SLURM_STEP_ID={step_id!r}" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Once a process, not at each detection.
        assert ce.detect_cluster_environment() is None


def test_a_one_task_sbatch_script_runs_alone_without_a_warning(bare, warn_again):
    setenv(bare, **dict(SBATCH, SLURM_NTASKS=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ce.detect_cluster_environment() is None


@pytest.mark.parametrize("job_name", ["bash", "interactive", "train"])
def test_an_srun_step_is_detected_whatever_the_job_name(bare, job_name):
    """`srun` inside `salloc` (job name `interactive` or the shell's) too."""
    setenv(bare, **dict(SLURM, SLURM_JOB_NAME=job_name))
    assert isinstance(ce.detect_cluster_environment(), ce.SlurmEnvironment)


def test_srun_pty_bash_is_one_process(bare):
    """`srun --pty bash`: a step of one task; what runs in it runs alone."""
    setenv(bare, **dict(SLURM, SLURM_STEP_NUM_TASKS=1, SLURM_PROCID=0))
    assert ce.detect_cluster_environment().world_size() == 1


def test_the_world_size_is_the_steps_not_the_jobs(bare):
    setenv(bare, **dict(SLURM, SLURM_NTASKS=8))  # The job's 8, the step's 4.
    assert ce.detect_cluster_environment().world_size() == 4


def test_slurm_rank_0_runs_on_the_steps_first_node_not_the_jobs(bare):
    setenv(bare, **dict(SLURM, SLURM_JOB_NODELIST="login,node[01-02]"))
    assert ce.detect_cluster_environment().main_address() == "node01"
    bare.delenv("SLURM_STEP_NODELIST")
    assert ce.detect_cluster_environment().main_address() == "login"
    bare.delenv("SLURM_JOB_NODELIST")
    bare.setenv("SLURM_NODELIST", "gpu[3-4]")
    assert ce.detect_cluster_environment().main_address() == "gpu3"


@pytest.mark.parametrize(
    "job_id, master_port, port",
    [("123456", None, 18456), ("42", None, 15042), ("9999", None, 24999)]
    + [("123456", "31000", 31000)],
)
def test_slurm_port_is_derived_from_the_job_id_unless_master_port_is_set(
    bare, job_id, master_port, port
):
    setenv(bare, **dict(SLURM, SLURM_JOB_ID=job_id))
    if master_port:
        bare.setenv("MASTER_PORT", master_port)
    assert ce.detect_cluster_environment().main_port() == port


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
        ("host[5-9]", ["host5", "host6", "host7", "host8", "host9"]),
        ("host[8-10]", ["host8", "host9", "host10"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("single", ["single"]),
        ("a,b c", ["a", "b", "c"]),
        ("n[1-2],m5,o[3-4,6]", ["n1", "n2", "m5", "o3", "o4", "o6"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("gpu[7]", ["gpu7"]),
    ],
)
def test_slurm_nodelists_expand_in_order(text, hosts):
    assert ce.expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text", ["node[01-03", "node01]", "node[3-1],other", "n[a-b]", "", ","]
)
def test_a_malformed_nodelist_names_its_variable(text):
    with pytest.raises(ce.ClusterEnvironmentError, match="SLURM_JOB_NODELIST"):
        ce.expand_nodelist(text, "SLURM_JOB_NODELIST")


def test_tasks_per_node_expand():
    assert ce.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert ce.expand_tasks_per_node("4") == [4]
    with pytest.raises(ce.ClusterEnvironmentError, match="SLURM_TASKS_PER_NODE"):
        ce.expand_tasks_per_node("2x3", "SLURM_TASKS_PER_NODE")


def test_openmpi_on_one_host(bare):
    setenv(bare, **OPENMPI)
    env = ce.detect_cluster_environment()
    assert isinstance(env, ce.OpenMPIEnvironment)
    assert values(env) == ("openmpi", 4, 3, 3, 0, "127.0.0.1", 29500)


def test_openmpi_across_hosts_needs_master_addr(bare):
    setenv(bare, **dict(OPENMPI, OMPI_COMM_WORLD_LOCAL_SIZE=2, MASTER_PORT=4000))
    env = ce.detect_cluster_environment()
    with pytest.raises(ce.ClusterEnvironmentError, match="MASTER_ADDR") as info:
        env.main_address()
    assert "mpirun -x MASTER_ADDR" in str(info.value)
    bare.setenv("MASTER_ADDR", "head")
    assert values(env) == ("openmpi", 4, 3, 3, None, "head", 4000)


def test_torchelastic_is_detected_with_its_values(bare):
    setenv(bare, **TORCHELASTIC)
    env = ce.detect_cluster_environment()
    assert isinstance(env, ce.TorchElasticEnvironment)
    assert values(env) == ("torchelastic", 2, 1, 1, 0, "10.0.0.5", 29400)


def test_a_kubeflow_job_without_local_rank_is_torchelastic(bare):
    setenv(bare, RANK=0, WORLD_SIZE=3, MASTER_ADDR="job-master-0", MASTER_PORT=23456)
    env = ce.detect_cluster_environment()
    assert values(env) == ("torchelastic", 3, 0, None, None, "job-master-0", 23456)


def test_keras_variables_with_every_address(bare):
    setenv(bare, **KERAS)
    env = ce.detect_cluster_environment()
    assert isinstance(env, ce.KerasDistributionEnvironment)
    # Rank 1 is the second process on 10.0.0.1, the first node.
    assert values(env) == ("keras", 3, 1, 1, 0, "10.0.0.1", 1234)
    bare.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "2")
    assert values(env)[2:5] == (2, 0, 1)
    # The number of processes may be left to the list.
    bare.delenv("KERAS_DISTRIBUTION_NUM_PROCESSES")
    assert env.world_size() == 3


def test_keras_variables_with_the_coordinator_only(bare):
    setenv(bare, **dict(KERAS, KERAS_DISTRIBUTION_JOB_ADDRESSES="coord:5000"))
    env = ce.detect_cluster_environment()
    assert values(env) == ("keras", 3, 1, None, None, "coord", 5000)


@pytest.mark.parametrize(
    "present, expected",
    [
        ((KERAS, TORCHELASTIC, SLURM, OPENMPI), ce.KerasDistributionEnvironment),
        ((TORCHELASTIC, SLURM, OPENMPI), ce.TorchElasticEnvironment),
        ((SLURM, OPENMPI), ce.SlurmEnvironment),
        ((OPENMPI,), ce.OpenMPIEnvironment),
    ],
)
def test_detection_order_keras_torchelastic_slurm_mpi(bare, present, expected):
    for variables in present:
        setenv(bare, **variables)
    assert type(ce.detect_cluster_environment()) is expected


@pytest.mark.parametrize(
    "base, changes, variable",
    [
        # A rank out of range, each environment's own variable named.
        (SLURM, dict(SLURM_PROCID=4), "SLURM_PROCID"),
        (SLURM, dict(SLURM_PROCID=-1), "SLURM_PROCID"),
        (OPENMPI, dict(OMPI_COMM_WORLD_RANK=9), "OMPI_COMM_WORLD_RANK"),
        (TORCHELASTIC, dict(RANK=2), "RANK"),
        (KERAS, dict(KERAS_DISTRIBUTION_PROCESS_ID=3), "KERAS_DISTRIBUTION_PROCESS_ID"),
        # A world size below 1.
        (SLURM, dict(SLURM_STEP_NUM_TASKS=0), "SLURM_STEP_NUM_TASKS"),
        (OPENMPI, dict(OMPI_COMM_WORLD_SIZE=-2), "OMPI_COMM_WORLD_SIZE"),
        (TORCHELASTIC, dict(WORLD_SIZE=0), "WORLD_SIZE"),
        # Not a number.
        (SLURM, dict(SLURM_PROCID="two"), "SLURM_PROCID"),
        (TORCHELASTIC, dict(LOCAL_RANK="x"), "LOCAL_RANK"),
        (TORCHELASTIC, dict(LOCAL_RANK=-1), "LOCAL_RANK"),
        # A missing address or port.
        (TORCHELASTIC, dict(MASTER_ADDR=""), "MASTER_ADDR"),
        (TORCHELASTIC, dict(MASTER_PORT=""), "MASTER_PORT"),
        (TORCHELASTIC, dict(MASTER_PORT=70000), "MASTER_PORT"),
        (SLURM, dict(SLURM_STEP_NODELIST=""), "SLURM_STEP_NODELIST"),
        (SLURM, dict(SLURM_STEP_NODELIST="node[1-"), "SLURM_STEP_NODELIST"),
        (SLURM, dict(SLURM_JOB_ID=""), "SLURM_JOB_ID"),
        (SLURM, dict(SLURM_JOB_ID="12_3"), "SLURM_JOB_ID"),
        (OPENMPI, dict(MASTER_PORT="http"), "MASTER_PORT"),
        (
            KERAS,
            dict(KERAS_DISTRIBUTION_JOB_ADDRESSES=""),
            "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        ),
        (
            KERAS,
            dict(KERAS_DISTRIBUTION_JOB_ADDRESSES="10.0.0.1"),
            "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        ),
        (
            KERAS,
            dict(KERAS_DISTRIBUTION_JOB_ADDRESSES=":1234"),
            "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        ),
        (
            KERAS,
            dict(KERAS_DISTRIBUTION_PROCESS_ID=""),
            "KERAS_DISTRIBUTION_PROCESS_ID",
        ),
        # Two addresses for three processes.
        (
            KERAS,
            dict(KERAS_DISTRIBUTION_JOB_ADDRESSES="a:1,b:1"),
            "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        ),
    ],
)
def test_a_wrong_variable_is_named(bare, base, changes, variable):
    setenv(bare, **dict(base, **changes))
    env = ce.detect_cluster_environment()
    with pytest.raises(ce.ClusterEnvironmentError) as info:
        env.validate()
    message = str(info.value)
    assert variable in message
    assert "Received: " in message and "; " in message.split("Received: ")[1]
    # `keras-parallel env` reports it rather than failing.
    assert variable in ce.describe_environment()
    assert "misconfigured" in ce.describe_environment()


@pytest.mark.parametrize(
    "base, variable",
    [
        (SLURM, "SLURM_STEP_NUM_TASKS"),
        (OPENMPI, "OMPI_COMM_WORLD_SIZE"),
        (TORCHELASTIC, "WORLD_SIZE"),
    ]
    + [(KERAS, "KERAS_DISTRIBUTION_NUM_PROCESSES")],
)
def test_a_world_size_below_1_is_named(bare, base, variable):
    setenv(bare, **dict(base, **{variable: 0}))
    with pytest.raises(
        ce.ClusterEnvironmentError, match=f"{variable} must be at least 1"
    ):
        ce.detect_cluster_environment().world_size()


def test_torch_variables(bare):
    setenv(bare, **SLURM)
    env = ce.detect_cluster_environment()
    assert ce.environment_variables(env, "torch") == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "18456",
    }


def test_torch_variables_leave_out_an_unknown_local_rank(bare):
    setenv(bare, **dict(KERAS, KERAS_DISTRIBUTION_JOB_ADDRESSES="coord:5000"))
    variables = ce.environment_variables(ce.detect_cluster_environment(), "torch")
    assert "LOCAL_RANK" not in variables
    assert variables["MASTER_ADDR"] == "coord"


def test_jax_arguments_and_variables(bare):
    setenv(bare, **SLURM)
    env = ce.detect_cluster_environment()
    assert ce.jax_initialize_arguments(env) == {
        "coordinator_address": "node01:18456",
        "num_processes": 4,
        "process_id": 2,
    }
    assert ce.environment_variables(env, "jax") == {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "node01:18456",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "4",
        "KERAS_DISTRIBUTION_PROCESS_ID": "2",
    }


def test_jax_coordinator_of_an_ipv6_host_is_bracketed(bare):
    setenv(bare, **dict(TORCHELASTIC, MASTER_ADDR="fe80::1"))
    arguments = ce.jax_initialize_arguments(ce.detect_cluster_environment())
    assert arguments["coordinator_address"] == "[fe80::1]:29401"  # See below.


def test_jax_under_torchrun_leaves_master_port_to_torchruns_store(bare):
    """torchrun's TCPStore holds MASTER_PORT: JAX's coordinator takes the next."""
    with socket.socket() as store:  # As torchrun's agent holds it.
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = store.getsockname()[1]
        setenv(bare, **dict(TORCHELASTIC, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        env = ce.detect_cluster_environment()
        coordinator = ce.jax_initialize_arguments(env)["coordinator_address"]
        assert coordinator == f"127.0.0.1:{port + 1}"
        assert ce.environment_variables(env, "jax") == {
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port + 1}",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            "KERAS_DISTRIBUTION_PROCESS_ID": "1",
        }
        # torch's own variables still name the store's port.
        assert ce.environment_variables(env, "torch")["MASTER_PORT"] == str(port)


@pytest.mark.parametrize("base", [SLURM, OPENMPI, KERAS])
def test_jax_coordinator_elsewhere_is_the_main_port(bare, base):
    setenv(bare, **base)
    env = ce.detect_cluster_environment()
    assert ce.jax_initialize_arguments(env)["coordinator_address"].endswith(
        f":{env.main_port()}"
    )


def tf_config(env):
    return json.loads(ce.environment_variables(env, "tensorflow")["TF_CONFIG"])


def test_tf_config_of_slurm_counts_ports_up_per_node(bare):
    setenv(bare, **dict(SLURM, SLURMD_NODENAME="node02"))
    assert tf_config(ce.detect_cluster_environment()) == {
        "cluster": {
            "worker": [
                "node01:18457",
                "node01:18458",
                "node02:18457",
                "node02:18458",
            ]
        },
        "task": {"type": "worker", "index": 2},
    }


def test_tf_config_of_uneven_slurm_nodes(bare):
    setenv(
        bare,
        **dict(
            SLURM,
            SLURM_STEP_NUM_TASKS=3,
            SLURM_STEP_NODELIST="a,b",
            SLURM_STEP_TASKS_PER_NODE="1,2",
        ),
    )
    workers = tf_config(ce.detect_cluster_environment())["cluster"]["worker"]
    assert workers == ["a:18457", "b:18457", "b:18458"]


@pytest.mark.parametrize(
    "changes, variable",
    [
        (dict(SLURM_STEP_TASKS_PER_NODE="3,2"), "SLURM_STEP_TASKS_PER_NODE"),
        (dict(SLURM_STEP_TASKS_PER_NODE="4"), "SLURM_STEP_TASKS_PER_NODE"),
        (dict(SLURM_STEP_TASKS_PER_NODE=""), "SLURM_STEP_TASKS_PER_NODE"),
        # Rank 2 is on node01: SLURM numbered the tasks round robin.
        (dict(SLURMD_NODENAME="node01"), "SLURM_DISTRIBUTION"),
    ],
)
def test_tf_config_of_a_wrong_slurm_layout_names_the_variable(bare, changes, variable):
    setenv(bare, **dict(SLURM, **changes))
    with pytest.raises(ce.ClusterEnvironmentError, match=variable):
        ce.environment_variables(ce.detect_cluster_environment(), "tensorflow")


def test_tf_config_on_one_host_and_given_addresses(bare):
    setenv(bare, **OPENMPI)
    assert tf_config(ce.detect_cluster_environment())["cluster"]["worker"] == [
        "127.0.0.1:29501",
        "127.0.0.1:29502",
        "127.0.0.1:29503",
        "127.0.0.1:29504",
    ]
    bare.delenv("OMPI_COMM_WORLD_SIZE")
    setenv(bare, **KERAS)
    assert tf_config(ce.detect_cluster_environment()) == {
        "cluster": {"worker": KERAS["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")},
        "task": {"type": "worker", "index": 1},
    }


def test_tf_config_needs_every_host(bare):
    setenv(bare, **dict(TORCHELASTIC, LOCAL_WORLD_SIZE=1))
    with pytest.raises(ce.ClusterEnvironmentError, match="TF_CONFIG"):
        ce.environment_variables(ce.detect_cluster_environment(), "tensorflow")


def test_an_unknown_backend_is_refused(bare):
    setenv(bare, **SLURM)
    with pytest.raises(ValueError, match="Received: backend='mxnet'"):
        ce.environment_variables(ce.detect_cluster_environment(), "mxnet")


def test_keras_parallel_env_names_the_environment(bare):
    bare.setattr(bug_report, "_devices", lambda: "1 (cpu:0)")
    assert (
        "cluster environment: none (a bare machine: use keras-parallel launch)"
        in bug_report.report().splitlines()
    )
    setenv(bare, **SLURM)
    assert (
        "cluster environment: slurm (world size 4, rank 2, local rank 0, node "
        "rank 1, main address node01:18456)"
    ) in bug_report.report().splitlines()


_GROUP_SCRIPT = r"""
import json, os
from keras_parallel.backends.torch import group

names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
unset = [n for n in names if n not in os.environ]
assert group.ensure_process_group()
import torch
import torch.distributed as dist

total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
line = json.dumps({
    "rank": dist.get_rank(),
    "world": dist.get_world_size(),
    "total": total.item(),
    "unset": unset,
    "port": os.environ["MASTER_PORT"],
    "local_rank": os.environ.get("LOCAL_RANK"),
})
os.write(1, (line + "\n").encode())  # One write: the ranks share the pipe.
group.teardown()
"""


def _free_slurm_port():
    """A free port in SLURM's derived range and the job id that derives it."""
    import random
    import socket

    for _ in range(50):
        # Not `random`'s shared generator, which Keras's seeding fixes.
        port = random.SystemRandom().randrange(15000, 25000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port, f"7{port - 15000:04d}"
    pytest.skip("no free port in 15000-24999")


@pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND") != "torch", reason="starts a torch group"
)
def test_two_srun_processes_form_one_torch_group(bare, tmp_path):
    """Two processes as `srun -n 2` starts them, no launcher of ours."""
    pytest.importorskip("torch")
    import sys

    from subprocesses import checkout_env, gone, run_in_session

    script = tmp_path / "srun_group_script.py"
    script.write_text(_GROUP_SCRIPT)
    port, job_id = _free_slurm_port()
    env = checkout_env(
        **dict(
            SLURM,
            SLURM_NTASKS=2,
            SLURM_STEP_NUM_TASKS=2,
            SLURM_STEP_NODELIST="127.0.0.1",
            SLURM_STEP_TASKS_PER_NODE="2",
            SLURM_NODEID=0,
            SLURM_JOB_ID=job_id,
            KERAS_BACKEND="torch",
            KERAS_PARALLEL_TIMEOUT="30",
        )
    )
    env = {name: str(value) for name, value in env.items()}
    # One shell as srun: rank 0 in the background, rank 1 in front.
    command = (
        f"SLURM_PROCID=0 SLURM_LOCALID=0 {sys.executable} {script} & first=$!; "
        f"SLURM_PROCID=1 SLURM_LOCALID=1 {sys.executable} {script}; second=$?; "
        'wait "$first"; exit $(( $? | second ))'
    )
    try:
        done = run_in_session(["bash", "-c", command], env, timeout=120)
    finally:
        assert not gone(str(script)), "a rank outlived the test"
    assert done.returncode == 0, done.stderr[-3000:]
    results = sorted(
        (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
        key=lambda result: result["rank"],
    )
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["world"] == 2
        assert result["total"] == 3.0  # 1 + 2: one group, both ranks summed.
        assert result["port"] == str(port)  # 15000 + the job id's last 4 digits
        assert result["local_rank"] == str(result["rank"])  # SLURM_LOCALID
        assert result["unset"] == [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ]


@pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND") != "torch", reason="imports the torch group"
)
def test_the_torch_group_fills_only_what_is_unset():
    pytest.importorskip("torch")
    from keras_parallel.backends.torch import group

    environ = {name: str(value) for name, value in SLURM.items()}
    environ["MASTER_ADDR"] = "head"
    assert group.fill_from_cluster_environment(environ) == [
        "RANK",
        "WORLD_SIZE",
        "MASTER_PORT",
        "LOCAL_RANK",
    ]
    assert environ["MASTER_ADDR"] == "head"
    assert (environ["RANK"], environ["WORLD_SIZE"]) == ("2", "4")
    # One process: no group to start, nothing set.
    alone = dict(SLURM, SLURM_NTASKS=1, SLURM_STEP_NUM_TASKS=1)
    alone = {name: str(value) for name, value in alone.items()}
    alone["SLURM_PROCID"] = "0"
    assert group.fill_from_cluster_environment(alone) == []
    assert "RANK" not in alone


def test_keras_parallel_cluster_off_detects_nothing(bare):
    setenv(bare, **dict(SLURM, KERAS_PARALLEL_CLUSTER="off"))
    assert ce.detect_cluster_environment() is None
    assert ce.describe_environment() == (
        "none: KERAS_PARALLEL_CLUSTER=off (every process runs alone)"
    )
    bare.setenv("KERAS_PARALLEL_CLUSTER", "auto")
    assert isinstance(ce.detect_cluster_environment(), ce.SlurmEnvironment)


def test_a_wrong_keras_parallel_cluster_is_named(bare):
    setenv(bare, **dict(SLURM, KERAS_PARALLEL_CLUSTER="of"))
    with pytest.raises(
        ce.ClusterEnvironmentError, match="KERAS_PARALLEL_CLUSTER must be 'off'"
    ):
        ce.detect_cluster_environment()
    assert "misconfigured" in ce.describe_environment()


@pytest.mark.parametrize(
    "cluster, task_type, role",
    [
        ({"chief": ["a:1"], "worker": ["b:1"]}, "worker", "chief"),
        ({"chief": ["a:1"], "worker": ["b:1"]}, "chief", "chief"),
        ({"ps": ["a:1"], "worker": ["b:1", "c:1"]}, "ps", "ps"),
        ({"worker": ["b:1", "c:1"], "evaluator": ["d:1"]}, "evaluator", "evaluator"),
        ({"worker": ["b:1", "c:1"]}, "evaluator", "evaluator"),
    ],
)
def test_a_tf_config_with_other_roles_than_workers_is_refused(
    bare, cluster, task_type, role
):
    from keras_parallel.cluster_environments import tf_config

    text = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0}})
    bare.setenv("TF_CONFIG", text)
    for read in (tf_config.cluster_workers, tf_config.wanted):
        with pytest.raises(ce.ClusterEnvironmentError) as info:
            read()
        message = str(info.value)
        assert message.startswith(f"TF_CONFIG names a {role!r} task")
        assert 'only clusters of "worker" tasks' in message
        assert f"this task's type {task_type!r}" in message
        assert "KERAS_PARALLEL_CLUSTER=off" in message


def test_a_tf_config_of_workers_is_read_and_off_ignores_it(bare):
    from keras_parallel.cluster_environments import tf_config

    workers = {"cluster": {"worker": ["a:1", "b:1"]}}
    bare.setenv("TF_CONFIG", json.dumps(dict(workers, task={"index": 1})))
    assert tf_config.cluster_workers() == (["a:1", "b:1"], 1)
    assert tf_config.wanted()
    bare.setenv("KERAS_PARALLEL_CLUSTER", "off")
    assert not tf_config.wanted()
