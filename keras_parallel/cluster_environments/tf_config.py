"""TensorFlow's `TF_CONFIG`, read without importing TensorFlow.

keras_parallel makes one `MultiWorkerMirroredStrategy` over its workers, worker
0 the chief; a cluster with other roles (`chief`, `ps`, `evaluator`) is refused
rather than read as workers it does not have.
"""

import json
import os

from keras_parallel.cluster_environments import detect_cluster_environment
from keras_parallel.cluster_environments.base import (
    ClusterEnvironment,
    environment_error,
)
from keras_parallel.cluster_environments.opt_out import OPT_OUT_VAR, opted_out

#: The only task type keras_parallel's strategy runs.
WORKER = "worker"
_EXAMPLE = (
    '{"cluster": {"worker": ["host0:12345", "host1:12345"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


def cluster_workers(environ=None):
    """`(worker addresses, this worker's index)` from `TF_CONFIG`, or `([], 0)`.

    Raises:
        ValueError: `TF_CONFIG` is not JSON with a `cluster.worker` list.
        ClusterEnvironmentError: `TF_CONFIG` names a task type other than
            `"worker"`; a `ValueError` too.
    """
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
    if not text.strip():
        return [], 0
    try:
        config = json.loads(text)
        cluster = config.get("cluster", {})
        task = config.get("task", {})
        addresses = list(cluster.get(WORKER, []))
        index = int(task.get("index", 0))
        roles = sorted(set(cluster) | {task.get("type", WORKER)})
    except (ValueError, AttributeError, TypeError) as error:
        raise ValueError(
            "TF_CONFIG is not a cluster description. Received: TF_CONFIG="
            f"{text[:200]!r} ({error}); set it to JSON such as {_EXAMPLE}."
        ) from None
    others = [role for role in roles if role != WORKER]
    if others:
        raise environment_error(
            f"TF_CONFIG names a {others[0]!r} task, and keras_parallel "
            'supports only clusters of "worker" tasks (one '
            "MultiWorkerMirroredStrategy, worker 0 the chief)",
            f"TF_CONFIG with the roles {roles} and this task's type "
            f"{task.get('type', WORKER)!r}",
            'list every process under "worker" (the first is the chief), or '
            f"set {OPT_OUT_VAR}=off to leave TF_CONFIG to a strategy of your own",
        )
    return addresses, index


def wanted(environ=None):
    """Whether `TF_CONFIG`, else the cluster environment, asks for several workers.

    False where `KERAS_PARALLEL_CLUSTER=off`. TensorFlow is not imported.

    Raises:
        ValueError: `TF_CONFIG` or a variable of the cluster environment is
            wrong (a `ClusterEnvironmentError` for all but bad JSON).
    """
    environ = os.environ if environ is None else environ
    if opted_out(environ):
        return False
    if len(cluster_workers(environ)[0]) > 1:
        return True
    if environ.get("TF_CONFIG", "").strip():
        return False  # The user's own TF_CONFIG wins.
    env = detect_cluster_environment(environ)
    return env is not None and env.world_size() > 1


class TFConfigEnvironment(ClusterEnvironment):
    """The workers a `TF_CONFIG` lists, read as a cluster environment.

    For the join's checks and messages (`join_deadline`) only: it is not
    among the detected environments, from whose variables a `TF_CONFIG` is
    computed.
    """

    name = "TF_CONFIG"
    WORLD_SIZE_VAR = "TF_CONFIG's cluster.worker"
    RANK_VAR = "TF_CONFIG's task.index"

    @classmethod
    def _detect(cls, environ):
        return len(cluster_workers(environ)[0]) > 1

    def world_size(self):
        return max(len(cluster_workers(self.environ)[0]), 1)

    def global_rank(self):
        addresses, index = cluster_workers(self.environ)
        if not 0 <= index < len(addresses):
            raise environment_error(
                f"TF_CONFIG's task.index must be in [0, {len(addresses)})",
                f"task.index={index} with {len(addresses)} workers listed",
                "give each worker its place in cluster.worker as its index",
            )
        return index

    def world_size_text(self):
        return f"{self.WORLD_SIZE_VAR} lists {self.world_size()}"

    def worker_addresses(self):
        return cluster_workers(self.environ)[0]

    def main_address(self):
        return self.worker_addresses()[0].rsplit(":", 1)[0].strip("[]")

    def main_port(self):
        return self._port("TF_CONFIG", self.worker_addresses()[0].rsplit(":", 1)[1])

    def port_source(self):
        return "TF_CONFIG"
