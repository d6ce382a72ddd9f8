"""torchrun and Kubeflow's PyTorchJob: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`."""

from keras_parallel.cluster_environments.base import (
    ClusterEnvironment,
    environment_error,
)


class TorchElasticEnvironment(ClusterEnvironment):
    """torchrun (torchelastic) and a Kubeflow PyTorchJob.

    `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` are required;
    `LOCAL_RANK` (absent: None) and `GROUP_RANK` (the node) are read when set.
    torchrun's own store holds `MASTER_PORT`: JAX's coordinator takes
    `MASTER_PORT + 1` (`engine_variables.jax_coordinator_port`).
    """

    name = "torchelastic"
    WORLD_SIZE_VAR = "WORLD_SIZE"
    RANK_VAR = "RANK"
    LOCAL_RANK_VAR = "LOCAL_RANK"

    @classmethod
    def _detect(cls, environ):
        return bool(environ.get("RANK") and environ.get("WORLD_SIZE"))

    def node_rank(self):
        return self._int("GROUP_RANK", required=False)

    def main_address(self):
        address = self._get("MASTER_ADDR")
        if address is None:
            raise environment_error(
                f"{self.name}: MASTER_ADDR is not set",
                f"RANK={self._get('RANK')!r}, WORLD_SIZE="
                f"{self._get('WORLD_SIZE')!r} and no MASTER_ADDR",
                "set MASTER_ADDR to the host of rank 0",
            )
        return address

    def main_port(self):
        port = self._get("MASTER_PORT")
        if port is None:
            raise environment_error(
                f"{self.name}: MASTER_PORT is not set",
                "no MASTER_PORT in this process's environment",
                "set MASTER_PORT to a free port on the host of rank 0",
            )
        return self._port("MASTER_PORT", port)

    def _single_host(self):
        local = self._int("LOCAL_WORLD_SIZE", required=False)
        return local == self.world_size()
