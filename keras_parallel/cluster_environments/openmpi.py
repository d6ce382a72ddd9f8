"""Open MPI's `mpirun`: `OMPI_COMM_WORLD_*`."""

from keras_parallel.cluster_environments.base import (
    ClusterEnvironment,
    environment_error,
)


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
    def _detect(cls, environ):
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
        raise environment_error(
            f"{self.name}: Open MPI does not say which host runs rank 0, and "
            "MASTER_ADDR is not set",
            f"{self.WORLD_SIZE_VAR}={self.world_size()}, {self.LOCAL_SIZE_VAR}="
            f"{self._get(self.LOCAL_SIZE_VAR)!r} (several hosts), no MASTER_ADDR",
            "pass rank 0's host: mpirun -x MASTER_ADDR=<host> ...",
        )

    def port_source(self):
        if self._get("MASTER_PORT") is None:
            return f"the default {self.DEFAULT_PORT}: MASTER_PORT is unset"
        return "MASTER_PORT"

    def main_port(self):
        port = self._get("MASTER_PORT")
        return self.DEFAULT_PORT if port is None else self._port("MASTER_PORT", port)
