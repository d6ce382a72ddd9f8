"""torch started by a cluster's own launcher: `srun`, `mpirun`, a Kubernetes job.

Two processes, each given only its launcher's variables (faked,
`tests/cluster_launchers.py`), must form one gloo process group at the
unchanged script's first `fit` (`backends/torch/group.py` fills torch's
`RANK`... `MASTER_PORT` from the detected environment): after one step both
hold single-process training's weights (1e-5), with process 0's initial
weights, and each rank's model saw 32 rows of the 64-row batch. Without
keras_parallel's reading of the environment (the `srun` case: torch reads
no `SLURM_*`), each process trains alone and the checks fail.
"""

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch processes (tox -e torch)"
)

if keras.backend.backend() == "torch":
    import cluster_launchers
    from cluster_launchers import (
        assert_plan_names_the_cluster,
        one_process_reference,
        results,
        start_two,
    )
    from split_probe import assert_divided


@pytest.fixture(scope="module")
def one_process():
    return one_process_reference()


def check_one_group(out, one_process):
    cluster_launchers.check_one_group(out, one_process, 2)


# One launcher a backend, each launcher on one backend (JAX mpirun, torch
# torchelastic, TensorFlow srun): the join reads one `ClusterEnvironment`
# whatever set it, and each launcher's variables are read in
# tests/test_cluster_environments.py.
@pytest.mark.parametrize("launcher", ["torchelastic"])
def test_two_processes_train_as_one_group(tmp_path, one_process, launcher):
    done = start_two(tmp_path, launcher, "torch", ports=1)
    assert done.returncode == 0, done.stderr[-4000:]
    check_one_group(tmp_path, one_process)
    assert_plan_names_the_cluster(results(tmp_path)[1], launcher)


def test_without_reading_the_environment_each_process_trains_alone(
    tmp_path, one_process
):
    """The red case: the checks above must catch it, within the timeout."""
    done = start_two(tmp_path, "srun", "torch", 1, joined=False)
    assert done.returncode == 0, done.stderr[-4000:]
    _, infos = results(tmp_path)
    with pytest.raises(AssertionError, match="not split"):
        assert_divided([tuple(r) for r in infos[0]["records"]], 64, 2)
    with pytest.raises(AssertionError):
        check_one_group(tmp_path, one_process)


def test_srun_processes_on_one_host_listen_on_loopback_only(tmp_path):
    # torch's `env://` store of rank 0 binds every interface whatever
    # MASTER_ADDR says: the join binds the address srun's first node has
    # (127.0.0.1 on one host). gloo's pairs listen where the host name
    # resolves (127.0.0.1 on the machines these tests run on).
    from listening_sockets import assert_loopback_only, sockets_while_in_fit

    argv, env = cluster_launchers.command_of_two(
        tmp_path,
        "srun",
        "torch",
        1,
        script="listening_script.py",
        KP_WAIT_S="3",
    )
    assert_loopback_only(*sockets_while_in_fit(argv, env, tmp_path, 2, 240))
