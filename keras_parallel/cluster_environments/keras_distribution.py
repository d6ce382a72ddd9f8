"""Keras's own `KERAS_DISTRIBUTION_*` (`keras.distribution.initialize`)."""

from keras_parallel.cluster_environments.base import (
    ClusterEnvironment,
    environment_error,
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
    def _detect(cls, environ):
        variables = (cls.ADDRESSES_VAR, cls.WORLD_SIZE_VAR, cls.RANK_VAR)
        return any(environ.get(v) for v in variables)

    def _addresses(self):
        text = self._get(self.ADDRESSES_VAR)
        if text is None:
            raise environment_error(
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
                raise environment_error(
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
            raise environment_error(
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

    def port_source(self):
        return self.ADDRESSES_VAR

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
