"""The cluster a process was started in, read from its environment.

On a cluster the scheduler starts the processes (`srun python train.py`,
`mpirun -n 8 python train.py`, a Kubernetes job), and each learns its place
from the variables the launcher sets. One class per launcher reads them, in
Lightning's shape (`detect()`, `world_size()`, `global_rank()`,
`local_rank()`, `node_rank()`, `main_address()`, `main_port()`):

- `KerasDistributionEnvironment`: Keras's own `KERAS_DISTRIBUTION_*`
  (`keras.distribution.initialize`; `keras-parallel launch --backend jax`);
- `TorchElasticEnvironment`: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
  `MASTER_PORT` (torchrun, a Kubeflow PyTorchJob);
- `SlurmEnvironment`: `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, ...);
- `OpenMPIEnvironment`: `mpirun` (`OMPI_COMM_WORLD_*`).

`detect_cluster_environment()` returns the first that applies, in that
order (an explicit setting wins over what a launcher around it set), or
None on a bare machine. `environment_variables(env, backend)` turns one
into what each backend's runtime reads: torch's `RANK`... `MASTER_PORT`,
the `KERAS_DISTRIBUTION_*` that become `jax.distributed.initialize`'s
arguments, TensorFlow's `TF_CONFIG`.

A value that cannot be right (a rank out of range, a world size below 1, no
address) raises `ClusterEnvironmentError` naming the variable to fix, when
it is read. A ground-layer module: it imports neither Keras nor a backend,
so the launcher and `keras-parallel env` can use it.
"""

import json
import os
import re


class ClusterEnvironmentError(ValueError):
    """A variable of the cluster's environment is missing or wrong."""


def _error(what, received, fix):
    return ClusterEnvironmentError(f"{what}. Received: {received}; {fix}.")


def _split_top_level(text, variable):
    """`text` split at commas and spaces outside brackets."""
    parts, current, depth = [], "", 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                break
        if depth == 0 and (char == "," or char.isspace()):
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise _error(
            f"{variable} has unbalanced brackets",
            f"{variable}={text!r}",
            "give a SLURM node list such as 'node[01-03,07],other'",
        )
    parts.append(current)
    return [p for p in parts if p]


def _expand_part(part, text, variable):
    match = re.search(r"\[([^\[\]]*)\]", part)
    if match is None:
        if "[" in part or "]" in part:
            raise _error(
                f"{variable} has a malformed node range",
                f"{variable}={text!r}",
                "give a SLURM node list such as 'node[01-03,07],other'",
            )
        return [part]
    prefix, rest = part[: match.start()], part[match.end() :]
    tails = _expand_part(rest, text, variable)
    hosts = []
    for item in match.group(1).split(","):
        low, dash, high = item.partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise _error(
                f"{variable} has a node range that is not 'first-last' numbers",
                f"{variable}={text!r} (range {item!r})",
                "give a SLURM node list such as 'node[01-03,07],other'",
            )
        for number in range(int(low), int(high) + 1):
            hosts.extend(f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails)
    return hosts


def expand_nodelist(text, variable="SLURM_STEP_NODELIST"):
    """The host names of a SLURM node list, in its order.

    Args:
        text: e.g. `"node[01-03,07],other"` (ranges keep their zero padding;
            several ranges in one name multiply, as in SLURM).
        variable: the variable it came from, for errors.

    Returns:
        e.g. `["node01", "node02", "node03", "node07", "other"]`.

    Raises:
        ClusterEnvironmentError: `text` is empty or not a node list.
    """
    hosts = []
    for part in _split_top_level(text, variable):
        hosts.extend(_expand_part(part, text, variable))
    if not hosts:
        raise _error(
            f"{variable} names no node",
            f"{variable}={text!r}",
            "start the processes with srun, which sets it",
        )
    return hosts


def expand_tasks_per_node(text, variable="SLURM_STEP_TASKS_PER_NODE"):
    """SLURM's tasks per node, one number per node: `"2(x3),1"` → `[2, 2, 2, 1]`.

    Raises:
        ClusterEnvironmentError: `text` is not in SLURM's form.
    """
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise _error(
                f"{variable} is not SLURM's tasks-per-node list",
                f"{variable}={text!r}",
                "give it as SLURM does, e.g. '2(x3),1'",
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _host_port(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ClusterEnvironment:
    """What a launcher tells each process: the base of every environment.

    Args:
        environ: the variables to read; `os.environ` when None.

    Subclasses name their variables (`WORLD_SIZE_VAR`, `RANK_VAR`, ...) and
    read the address and port their own way.
    """

    #: A short name, for messages and `keras-parallel env`.
    name = None
    WORLD_SIZE_VAR = None
    RANK_VAR = None
    LOCAL_RANK_VAR = None

    def __init__(self, environ=None):
        self.environ = os.environ if environ is None else environ

    @classmethod
    def detect(cls, environ=None):
        """Whether the process was started in this environment."""
        raise NotImplementedError

    def _get(self, variable):
        value = self.environ.get(variable)
        return value.strip() if value and value.strip() else None

    def _int(self, variable, required=True):
        value = self._get(variable)
        if value is None:
            if not required:
                return None
            raise _error(
                f"{self.name}: {variable} is not set",
                f"no {variable} in this process's environment",
                f"set {variable} (the {self.name} launcher sets it)",
            )
        try:
            return int(value)
        except ValueError:
            raise _error(
                f"{self.name}: {variable} must be a whole number",
                f"{variable}={value!r}",
                f"set {variable} to a number",
            ) from None

    def world_size(self):
        """How many processes the job has, 1 or more."""
        size = self._int(self.WORLD_SIZE_VAR)
        if size < 1:
            raise _error(
                f"{self.name}: {self.WORLD_SIZE_VAR} must be at least 1",
                f"{self.WORLD_SIZE_VAR}={size}",
                f"set {self.WORLD_SIZE_VAR} to the number of processes",
            )
        return size

    def global_rank(self):
        """This process's rank, in `[0, world_size())`."""
        rank, size = self._int(self.RANK_VAR), self.world_size()
        if not 0 <= rank < size:
            raise _error(
                f"{self.name}: {self.RANK_VAR} must be in [0, {size})",
                f"{self.RANK_VAR}={rank}, {self.WORLD_SIZE_VAR}={size}",
                f"give the {size} processes the ranks 0 to {size - 1}, "
                f"or fix {self.WORLD_SIZE_VAR}",
            )
        return rank

    def local_rank(self):
        """This process's index on its node, or None where not told."""
        rank = self._int(self.LOCAL_RANK_VAR, required=False)
        if rank is not None and rank < 0:
            raise _error(
                f"{self.name}: {self.LOCAL_RANK_VAR} must be 0 or more",
                f"{self.LOCAL_RANK_VAR}={rank}",
                f"set {self.LOCAL_RANK_VAR} to this process's index on its node",
            )
        return rank

    def node_rank(self):
        """This node's index, or None where the environment does not tell."""
        return None

    def main_address(self):
        """The host of rank 0, where the others meet."""
        raise NotImplementedError

    def main_port(self):
        """The port on `main_address()` where the others meet."""
        raise NotImplementedError

    def _port(self, variable, value):
        try:
            port = int(value)
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise _error(
                f"{self.name}: {variable} must be a port number (1 to 65535)",
                f"{variable}={value!r}",
                f"set {variable} to a free port on rank 0's host",
            )
        return port

    def worker_addresses(self):
        """Every process's `host:port`, in rank order (TensorFlow's workers).

        Process `r` on its host listens on `main_port() + 1 + its index on
        that host`: `main_port()` itself is left to the coordinator (torch's
        store), and tasks on one host count up from a base, as
        `tf.distribute.cluster_resolver.SlurmClusterResolver` does.

        Raises:
            ClusterEnvironmentError: the environment does not say every
                process's host.
        """
        size = self.world_size()
        if size == 1 or self._single_host():
            return [
                _host_port(self.main_address(), self.main_port() + 1 + rank)
                for rank in range(size)
            ]
        raise _error(
            f"{self.name}: TensorFlow needs every worker's host, and this "
            "environment names only rank 0's",
            f"{self.WORLD_SIZE_VAR}={size} over several hosts",
            "set TF_CONFIG in each process (its worker list and index), or "
            "start the job with srun",
        )

    def _single_host(self):
        return False

    def validate(self):
        """Reads every value once, so a wrong one fails now. Returns self."""
        self.global_rank()
        self.local_rank()
        self.node_rank()
        self.main_address()
        self.main_port()
        return self

    def describe(self):
        """One line: the environment, the world size, the ranks, the address."""
        return (
            f"{self.name} (world size {self.world_size()}, rank "
            f"{self.global_rank()}, local rank {self.local_rank()}, node rank "
            f"{self.node_rank()}, main address "
            f"{_host_port(self.main_address(), self.main_port())})"
        )


class KerasDistributionEnvironment(ClusterEnvironment):
    """Keras's own variables, as `keras.distribution.initialize()` reads them.

    `KERAS_DISTRIBUTION_JOB_ADDRESSES` is the coordinator's `host:port`, or
    every process's, comma separated (the first is the coordinator);
    `KERAS_DISTRIBUTION_NUM_PROCESSES` the world size (else the number of
    addresses); `KERAS_DISTRIBUTION_PROCESS_ID` the rank.
    """

    name = "keras"
    ADDRESSES_VAR = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
    WORLD_SIZE_VAR = "KERAS_DISTRIBUTION_NUM_PROCESSES"
    RANK_VAR = "KERAS_DISTRIBUTION_PROCESS_ID"

    @classmethod
    def detect(cls, environ=None):
        environ = os.environ if environ is None else environ
        variables = (cls.ADDRESSES_VAR, cls.WORLD_SIZE_VAR, cls.RANK_VAR)
        return any(environ.get(v) for v in variables)

    def _addresses(self):
        text = self._get(self.ADDRESSES_VAR)
        if text is None:
            raise _error(
                f"{self.name}: {self.ADDRESSES_VAR} is not set",
                f"{self.WORLD_SIZE_VAR}={self._get(self.WORLD_SIZE_VAR)!r}, "
                f"{self.RANK_VAR}={self._get(self.RANK_VAR)!r} and no "
                f"{self.ADDRESSES_VAR}",
                f"set {self.ADDRESSES_VAR} to the coordinator's host:port",
            )
        addresses = [a.strip() for a in text.split(",")]
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host.strip("[]"):
                raise _error(
                    f"{self.name}: each of {self.ADDRESSES_VAR} must be host:port",
                    f"{self.ADDRESSES_VAR}={text!r}",
                    "write e.g. '10.0.0.1:1234' or '10.0.0.1:1234,10.0.0.2:1234'",
                )
            self._port(self.ADDRESSES_VAR, port)
        return addresses

    def world_size(self):
        if self._get(self.WORLD_SIZE_VAR) is None:
            addresses = self._addresses()
            if len(addresses) > 1:
                return len(addresses)
        size = super().world_size()
        addresses = self._addresses()
        if len(addresses) > 1 and len(addresses) != size:
            raise _error(
                f"{self.name}: {self.ADDRESSES_VAR} must list one address per "
                f"process, or only the coordinator's",
                f"{len(addresses)} addresses, {self.WORLD_SIZE_VAR}={size}",
                f"fix {self.ADDRESSES_VAR} or {self.WORLD_SIZE_VAR}",
            )
        return size

    def _split(self, address):
        host, _, port = address.rpartition(":")
        return host.strip("[]"), int(port)

    def main_address(self):
        return self._split(self._addresses()[0])[0]

    def main_port(self):
        return self._split(self._addresses()[0])[1]

    def _hosts(self):
        addresses = self._addresses()
        return [self._split(a)[0] for a in addresses] if len(addresses) > 1 else None

    def local_rank(self):
        """The rank among the earlier addresses on the same host, when all are listed."""
        hosts, rank = self._hosts(), self.global_rank()
        if hosts is None:
            return 0 if self.world_size() == 1 else None
        return hosts[:rank].count(hosts[rank])

    def node_rank(self):
        hosts, rank = self._hosts(), self.global_rank()
        if hosts is None:
            return 0 if self.world_size() == 1 else None
        return list(dict.fromkeys(hosts)).index(hosts[rank])

    def worker_addresses(self):
        addresses = self._addresses()
        if len(addresses) > 1 or self.world_size() == 1:
            return addresses
        return super().worker_addresses()


class TorchElasticEnvironment(ClusterEnvironment):
    """torchrun (torchelastic) and a Kubeflow PyTorchJob.

    `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` are required;
    `LOCAL_RANK` (absent: None) and `GROUP_RANK` (the node) are read when set.
    """

    name = "torchelastic"
    WORLD_SIZE_VAR = "WORLD_SIZE"
    RANK_VAR = "RANK"
    LOCAL_RANK_VAR = "LOCAL_RANK"

    @classmethod
    def detect(cls, environ=None):
        environ = os.environ if environ is None else environ
        return bool(environ.get("RANK") and environ.get("WORLD_SIZE"))

    def node_rank(self):
        return self._int("GROUP_RANK", required=False)

    def main_address(self):
        address = self._get("MASTER_ADDR")
        if address is None:
            raise _error(
                f"{self.name}: MASTER_ADDR is not set",
                f"RANK={self._get('RANK')!r}, WORLD_SIZE="
                f"{self._get('WORLD_SIZE')!r} and no MASTER_ADDR",
                "set MASTER_ADDR to the host of rank 0",
            )
        return address

    def main_port(self):
        port = self._get("MASTER_PORT")
        if port is None:
            raise _error(
                f"{self.name}: MASTER_PORT is not set",
                "no MASTER_PORT in this process's environment",
                "set MASTER_PORT to a free port on the host of rank 0",
            )
        return self._port("MASTER_PORT", port)

    def _single_host(self):
        local = self._int("LOCAL_WORLD_SIZE", required=False)
        return local == self.world_size()


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
        raise _error(
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
            raise _error(
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
            raise _error(
                f"{self.name}: {variable} does not match the node list and "
                f"{self.WORLD_SIZE_VAR}",
                f"{variable}={text!r} ({len(counts)} nodes, {sum(counts)} "
                f"tasks), {len(hosts)} nodes listed, {self.WORLD_SIZE_VAR}={size}",
                "start the processes with one srun, which sets them together",
            )
        base = self.main_port() + 1
        addresses = [
            _host_port(host, base + index)
            for host, count in zip(hosts, counts, strict=True)
            for index in range(count)
        ]
        own = self._get("SLURMD_NODENAME")
        rank = self.global_rank()
        if own is not None and addresses[rank].rpartition(":")[0] != own:
            raise _error(
                f"{self.name}: tasks are not numbered node after node, so "
                "rank order does not follow the node list",
                f"{self.RANK_VAR}={rank} on SLURMD_NODENAME={own!r}, "
                f"SLURM_DISTRIBUTION={self._get('SLURM_DISTRIBUTION')!r}",
                "start the step with srun --distribution=block",
            )
        return addresses


class OpenMPIEnvironment(ClusterEnvironment):
    """Processes started by Open MPI's `mpirun`.

    The rank is `OMPI_COMM_WORLD_RANK` of `OMPI_COMM_WORLD_SIZE`, task
    `OMPI_COMM_WORLD_LOCAL_RANK` of its host. Open MPI does not export rank
    0's host: on one host it is `127.0.0.1`; across hosts pass `MASTER_ADDR`
    (`mpirun -x MASTER_ADDR=<host of rank 0>`). The port is `MASTER_PORT`,
    else 29500 (torch's default).
    """

    name = "openmpi"
    WORLD_SIZE_VAR = "OMPI_COMM_WORLD_SIZE"
    RANK_VAR = "OMPI_COMM_WORLD_RANK"
    LOCAL_RANK_VAR = "OMPI_COMM_WORLD_LOCAL_RANK"
    LOCAL_SIZE_VAR = "OMPI_COMM_WORLD_LOCAL_SIZE"
    DEFAULT_PORT = 29500

    @classmethod
    def detect(cls, environ=None):
        environ = os.environ if environ is None else environ
        return bool(environ.get(cls.WORLD_SIZE_VAR))

    def _single_host(self):
        return self._int(self.LOCAL_SIZE_VAR, required=False) == self.world_size()

    def node_rank(self):
        return 0 if self._single_host() else None

    def main_address(self):
        address = self._get("MASTER_ADDR")
        if address is not None:
            return address
        if self._single_host():
            return "127.0.0.1"
        raise _error(
            f"{self.name}: Open MPI does not say which host runs rank 0, and "
            "MASTER_ADDR is not set",
            f"{self.WORLD_SIZE_VAR}={self.world_size()}, {self.LOCAL_SIZE_VAR}="
            f"{self._get(self.LOCAL_SIZE_VAR)!r} (several hosts), no MASTER_ADDR",
            "pass rank 0's host: mpirun -x MASTER_ADDR=<host> ...",
        )

    def main_port(self):
        port = self._get("MASTER_PORT")
        return self.DEFAULT_PORT if port is None else self._port("MASTER_PORT", port)


#: The order of detection: an explicit setting first, then the launchers.
ENVIRONMENTS = (
    KerasDistributionEnvironment,
    TorchElasticEnvironment,
    SlurmEnvironment,
    OpenMPIEnvironment,
)


def detect_cluster_environment(environ=None):
    """The environment this process was started in, or None on a bare machine.

    Args:
        environ: the variables to read; `os.environ` when None.

    Returns:
        An instance of the first of `ENVIRONMENTS` whose `detect()` is true
        (not yet validated: `validate()` reads every value), or None.
    """
    for environment in ENVIRONMENTS:
        if environment.detect(environ):
            return environment(environ)
    return None


BACKENDS = ("torch", "jax", "tensorflow")


def jax_initialize_arguments(env):
    """`jax.distributed.initialize`'s arguments for `env`.

    Returns:
        `{"coordinator_address", "num_processes", "process_id"}`.
    """
    return {
        "coordinator_address": _host_port(env.main_address(), env.main_port()),
        "num_processes": env.world_size(),
        "process_id": env.global_rank(),
    }


def environment_variables(env, backend):
    """The variables `backend`'s runtime reads, computed from `env`.

    Pure: nothing is set. The runtimes read these as they read what
    `keras-parallel launch` sets: torch's process group `RANK`,
    `WORLD_SIZE`, `LOCAL_RANK` (left out where `env` does not tell),
    `MASTER_ADDR`, `MASTER_PORT`; JAX the `KERAS_DISTRIBUTION_*` that
    `keras.distribution.initialize()` passes to `jax.distributed.initialize`
    (see `jax_initialize_arguments`); TensorFlow `TF_CONFIG`, every worker's
    `host:port` and this one's index.

    Args:
        env: a `ClusterEnvironment`.
        backend: `"torch"`, `"jax"` or `"tensorflow"`.

    Returns:
        A dict of variable names to string values.

    Raises:
        ClusterEnvironmentError: a variable of `env` is wrong; it is named.
    """
    if backend == "torch":
        variables = {
            "RANK": str(env.global_rank()),
            "WORLD_SIZE": str(env.world_size()),
            "MASTER_ADDR": env.main_address(),
            "MASTER_PORT": str(env.main_port()),
        }
        local = env.local_rank()
        if local is not None:
            variables["LOCAL_RANK"] = str(local)
        return variables
    if backend == "jax":
        arguments = jax_initialize_arguments(env)
        return {
            KerasDistributionEnvironment.ADDRESSES_VAR: arguments[
                "coordinator_address"
            ],
            KerasDistributionEnvironment.WORLD_SIZE_VAR: str(
                arguments["num_processes"]
            ),
            KerasDistributionEnvironment.RANK_VAR: str(arguments["process_id"]),
        }
    if backend == "tensorflow":
        config = {
            "cluster": {"worker": env.worker_addresses()},
            "task": {"type": "worker", "index": env.global_rank()},
        }
        return {"TF_CONFIG": json.dumps(config)}
    raise ValueError(
        f"backend must be one of {', '.join(BACKENDS)}. Received: "
        f"backend={backend!r}; pass one of those."
    )


def describe_environment(environ=None):
    """`keras-parallel env`'s line: the detected environment, or none.

    Never raises: a wrong variable is reported with its error.
    """
    env = detect_cluster_environment(environ)
    if env is None:
        return "none (a bare machine: use keras-parallel launch)"
    try:
        return env.describe()
    except ClusterEnvironmentError as error:
        return f"{env.name}, misconfigured: {error}"
