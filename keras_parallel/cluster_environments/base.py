"""What every cluster environment shares: the base class and its error."""

import os
import socket


class ClusterEnvironmentError(ValueError):
    """A variable of the cluster's environment is missing or wrong."""


def environment_error(what, received, fix):
    """A `ClusterEnvironmentError` in the form "what. Received: ...; fix."."""
    return ClusterEnvironmentError(f"{what}. Received: {received}; {fix}.")


def positive_seconds(environ, variable, default, example):
    """Seconds read from `environ[variable]`, or `default` where unset or blank.

    `example` is a value the error suggests.

    Raises:
        ClusterEnvironmentError: the value is not a positive number.
    """
    text = environ.get(variable, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise environment_error(
            f"{variable} must be a positive number of seconds",
            f"{variable}={text!r}",
            f"set it to, e.g., {example}, or unset it for {default:g}",
        )
    return seconds


#: A port the launcher holds for this process's server (a gRPC server of the
#: same user, which binds with SO_REUSEPORT, takes it: `launcher.ports`).
HELD_PORT_VAR = "KERAS_PARALLEL_HELD_PORT"


def bind_error(host, port, reuse_port=False):
    """Why a server could not listen on `port` here (the `OSError`), or None.

    Binds with SO_REUSEADDR, as the runtimes' servers do (gRPC, libuv): a port
    the last run left in TIME-WAIT is free to them, one something listens on
    is not; a plain bind would refuse both for about 60 s. `host` `""` is
    every interface. `reuse_port`: with SO_REUSEPORT too, as gRPC binds (a
    port this user's launcher holds for it is free to it).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return error
    return None


def host_port(host, port):
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ClusterEnvironment:
    """What a launcher tells each process: the base of every environment.

    Subclasses name their variables (`WORLD_SIZE_VAR`, `RANK_VAR`, ...) and
    read the address and port their own way. `environ` defaults to `os.environ`.
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
        return cls._detect(os.environ if environ is None else environ)

    @classmethod
    def _detect(cls, environ):
        raise NotImplementedError

    def _get(self, variable):
        if variable is None:
            return None  # An environment that has no such variable.
        value = self.environ.get(variable)
        return value.strip() if value and value.strip() else None

    def _int(self, variable, required=True):
        value = self._get(variable)
        if value is None:
            if not required:
                return None
            raise environment_error(
                f"{self.name}: {variable} is not set",
                f"no {variable} in this process's environment",
                f"set {variable} (the {self.name} launcher sets it)",
            )
        try:
            return int(value)
        except ValueError:
            raise environment_error(
                f"{self.name}: {variable} must be a whole number",
                f"{variable}={value!r}",
                f"set {variable} to a number",
            ) from None

    def world_size(self):
        """How many processes the job has, 1 or more."""
        size = self._int(self.WORLD_SIZE_VAR)
        if size < 1:
            raise environment_error(
                f"{self.name}: {self.WORLD_SIZE_VAR} must be at least 1",
                f"{self.WORLD_SIZE_VAR}={size}",
                f"set {self.WORLD_SIZE_VAR} to the number of processes",
            )
        return size

    def global_rank(self):
        """This process's rank, in `[0, world_size())`."""
        rank, size = self._int(self.RANK_VAR), self.world_size()
        if not 0 <= rank < size:
            raise environment_error(
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
            raise environment_error(
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

    def world_size_text(self):
        """Where the world size comes from, for messages: `VARIABLE=value`."""
        return f"{self.WORLD_SIZE_VAR}={self.world_size()}"

    def port_source(self):
        """Where `main_port()` comes from, for messages: a variable to set."""
        return "MASTER_PORT"

    def _port(self, variable, value):
        try:
            port = int(value)
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise environment_error(
                f"{self.name}: {variable} must be a port number (1 to 65535)",
                f"{variable}={value!r}",
                f"set {variable} to a free port on rank 0's host",
            )
        return port

    def worker_addresses(self):
        """Every process's `host:port`, in rank order (TensorFlow's workers).

        A process listens on `main_port() + 1 +` its index on its host (as
        TensorFlow's `SlurmClusterResolver` counts), leaving `main_port()` to
        the coordinator (torch's store).

        Raises:
            ClusterEnvironmentError: the environment does not name every host.
        """
        size = self.world_size()
        if size == 1 or self._single_host():
            return [
                host_port(self.main_address(), self.main_port() + 1 + rank)
                for rank in range(size)
            ]
        raise environment_error(
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
            f"{host_port(self.main_address(), self.main_port())})"
        )
