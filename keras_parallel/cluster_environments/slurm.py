"""SLURM's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, the step's node list."""

import os

from keras_parallel.cluster_environments.base import (
    ClusterEnvironment,
    environment_error,
    host_port,
)
from keras_parallel.cluster_environments.nodelists import (
    expand_nodelist,
    expand_tasks_per_node,
)


class SlurmEnvironment(ClusterEnvironment):
    """Processes started by `srun`.

    The rank is `SLURM_PROCID` of `SLURM_NTASKS`, on node `SLURM_NODEID` as
    task `SLURM_LOCALID`; rank 0 runs on the first node of the step
    (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST` / `SLURM_NODELIST`:
    the job may hold nodes the step does not use). The port is `MASTER_PORT`
    when set, else `15000 + the last 4 digits of SLURM_JOB_ID`, as Lightning
    does, so every process finds it alone and two jobs rarely share one. An
    interactive allocation (`SLURM_JOB_NAME` `bash` or `interactive`, as
    `salloc` gives) is not a launched job: it is not detected, so processes
    started in it by hand are read as their own launcher left them.
    """

    name = "slurm"
    WORLD_SIZE_VAR = "SLURM_NTASKS"
    RANK_VAR = "SLURM_PROCID"
    LOCAL_RANK_VAR = "SLURM_LOCALID"
    NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    #: Lightning's rule: the port is this plus the job id's last 4 digits.
    PORT_BASE = 15000

    @classmethod
    def detect(cls, environ=None):
        environ = os.environ if environ is None else environ
        interactive = environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
        return bool(environ.get("SLURM_NTASKS")) and not interactive

    def node_rank(self):
        return self._int("SLURM_NODEID", required=False)

    def _first_set(self, variables):
        for variable in variables:
            value = self._get(variable)
            if value is not None:
                return variable, value
        raise environment_error(
            f"{self.name}: {variables[0]} is not set",
            f"none of {', '.join(variables)} in this process's environment",
            "start the processes with srun, which sets them",
        )

    def nodes(self):
        """The step's host names, in SLURM's order."""
        variable, text = self._first_set(self.NODELIST_VARS)
        return expand_nodelist(text, variable)

    def main_address(self):
        return self.nodes()[0]

    def main_port(self):
        explicit = self._get("MASTER_PORT")
        if explicit is not None:
            return self._port("MASTER_PORT", explicit)
        job_id = self._get("SLURM_JOB_ID")
        if job_id is None or not job_id.isdigit():
            raise environment_error(
                f"{self.name}: the port is derived from SLURM_JOB_ID, which "
                "is not a job number",
                f"SLURM_JOB_ID={job_id!r}",
                "run under sbatch/srun, which set it, or set MASTER_PORT",
            )
        return self.PORT_BASE + int(job_id[-4:])

    def worker_addresses(self):
        """Every task's `host:port`, in rank order, from the step's layout.

        SLURM numbers tasks node after node (block distribution, its
        default): the `n` tasks of a node (`SLURM_STEP_TASKS_PER_NODE`) are
        consecutive ranks, and listen on `main_port() + 1 + 0 ... n - 1`.
        """
        hosts = self.nodes()
        variable, text = self._first_set(self.TASKS_PER_NODE_VARS)
        counts = expand_tasks_per_node(text, variable)
        size = self.world_size()
        if len(counts) != len(hosts) or sum(counts) != size:
            raise environment_error(
                f"{self.name}: {variable} does not match the node list and "
                f"{self.WORLD_SIZE_VAR}",
                f"{variable}={text!r} ({len(counts)} nodes, {sum(counts)} "
                f"tasks), {len(hosts)} nodes listed, {self.WORLD_SIZE_VAR}={size}",
                "start the processes with one srun, which sets them together",
            )
        base = self.main_port() + 1
        addresses = [
            host_port(host, base + index)
            for host, count in zip(hosts, counts, strict=True)
            for index in range(count)
        ]
        own = self._get("SLURMD_NODENAME")
        rank = self.global_rank()
        if own is not None and addresses[rank].rpartition(":")[0] != own:
            raise environment_error(
                f"{self.name}: tasks are not numbered node after node, so "
                "rank order does not follow the node list",
                f"{self.RANK_VAR}={rank} on SLURMD_NODENAME={own!r}, "
                f"SLURM_DISTRIBUTION={self._get('SLURM_DISTRIBUTION')!r}",
                "start the step with srun --distribution=block",
            )
        return addresses
