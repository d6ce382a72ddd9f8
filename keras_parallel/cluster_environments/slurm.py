"""SLURM's `srun`: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, the step's node list."""

import os
import warnings

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
    """Processes started by `srun`: the tasks of one job step.

    The rank is `SLURM_PROCID` of `SLURM_STEP_NUM_TASKS`, on node
    `SLURM_NODEID` as task `SLURM_LOCALID`; rank 0 runs on the step's first
    node (the step's node list first: the job may hold nodes the step does
    not use). The port is `MASTER_PORT`, else `PORT_BASE` + the job id's last
    4 digits, as Lightning does.

    Only srun's tasks are detected: srun sets `SLURM_STEP_ID` (a normal
    step's) and `SLURM_STEP_NUM_TASKS` in each (`env_array_for_step`, SLURM's
    `src/common/env.c`). An `sbatch` script or `salloc` shell carries
    `SLURM_NTASKS` but is one process, with no step id or a special step's,
    so it runs alone (with a warning). Unlike Lightning's job-name rule, this
    also covers an `srun` started inside `salloc`.
    """

    name = "slurm"
    #: The step's task count: srun sets it in each task (with `SLURM_NTASKS`).
    WORLD_SIZE_VAR = "SLURM_STEP_NUM_TASKS"
    RANK_VAR = "SLURM_PROCID"
    LOCAL_RANK_VAR = "SLURM_LOCALID"
    NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    STEP_ID_VAR = "SLURM_STEP_ID"
    #: SLURM's special steps (batch, extern, interactive) have ids from this
    #: one up (`SLURM_MAX_NORMAL_STEP_ID` in `slurm.h`); srun's are below.
    MAX_NORMAL_STEP_ID = 0xFFFFFFF0
    #: Lightning's rule: the port is this plus the job id's last 4 digits.
    PORT_BASE = 15000

    @classmethod
    def _detect(cls, environ):
        """Whether this process is a task of an `srun` step.

        Outside one, a `SLURM_NTASKS` above 1 warns once and the process runs
        alone: waiting for tasks nobody started would hang the import.
        """
        if cls.in_srun_step(environ):
            return True
        _warn_if_several_tasks_were_meant(environ)
        return False

    @classmethod
    def in_srun_step(cls, environ=None):
        """Whether `SLURM_STEP_ID` is a normal step's and `SLURM_STEP_NUM_TASKS` set.

        False in a batch script, a `salloc` shell (with or without SLURM's
        interactive step) and outside SLURM.
        """
        environ = os.environ if environ is None else environ
        step = (environ.get(cls.STEP_ID_VAR) or "").strip()
        normal = step.isdigit() and int(step) < cls.MAX_NORMAL_STEP_ID
        return normal and bool((environ.get(cls.WORLD_SIZE_VAR) or "").strip())

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

    def port_source(self):
        if self._get("MASTER_PORT") is None:
            return (
                f"SLURM_JOB_ID ({self.PORT_BASE} + its last 4 digits); set "
                "MASTER_PORT to choose another"
            )
        return "MASTER_PORT"

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


class NotStartedBySrunWarning(UserWarning):
    """`SLURM_NTASKS` asks for several tasks, but srun did not start this one."""


#: Whether the warning was given: once per process, not at each detection.
_warned = False


def _warn_if_several_tasks_were_meant(environ):
    global _warned
    tasks = (environ.get("SLURM_NTASKS") or "").strip()
    if _warned or not tasks.isdigit() or int(tasks) <= 1:
        return
    _warned = True
    step = environ.get(SlurmEnvironment.STEP_ID_VAR)
    warnings.warn(
        f"keras_parallel: this SLURM job has SLURM_NTASKS={tasks}, but this "
        "process is not a task of an srun step (an sbatch script or a salloc "
        "shell), so it runs alone and joins no other process. Received: "
        f"SLURM_NTASKS={tasks}, SLURM_STEP_ID={step!r}; start the script "
        "with `srun python train.py` to run it as one training of "
        f"{tasks} processes.",
        NotStartedBySrunWarning,
        stacklevel=2,
    )
