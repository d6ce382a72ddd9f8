"""torchrun's rendezvous, with its store listening where the run asks only.

A `TCPStore` server binds every interface whatever host name it is given,
so any host that reaches the machine could join the group. Here the store
listens on a socket of ours, bound to one address, and handed to it
(`TCPStore(master_listen_fd=...)`):

- one node (`BACKEND`, in place of `torchrun --standalone`, which opens two
  stores on every interface: the c10d rendezvous's and the one the ranks
  share): the rendezvous's store on 127.0.0.1 (`ports.loopback_listener`),
  which the ranks share too. The launch listens on one port, on loopback.
- several nodes (`STATIC`, in place of torchrun's static rendezvous of
  `--master-addr A --master-port P --node-rank R`): node 0's store bound to
  A alone.

Both are registered with torch's rendezvous registry (its documented way
to add a rendezvous), and `keras-parallel launch` passes them
(`loopback_options`, `static_options`).
"""

import socket
import uuid
from datetime import timedelta

from keras_parallel.cluster_environments.base import host_port
from keras_parallel.launcher.ports import loopback_listener

#: The name torchrun's `--rdzv-backend` knows each by.
BACKEND = "keras-parallel-loopback"
STATIC = "keras-parallel-static"
#: torchrun's static rendezvous's defaults.
_MASTER_ADDR, _MASTER_PORT = "127.0.0.1", 29500
#: torch's own default for the c10d store's reads (`read_timeout`).
_READ_TIMEOUT_S = 60


def loopback_options(torchrun_options):
    """torchrun's options (a list) for a one-node run on loopback, in place
    of `--standalone`. A `--local-addr` among the user's `torchrun_options`
    (before the script) is kept: it must be this machine's loopback."""
    out = [
        "--rdzv-backend",
        BACKEND,
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--rdzv-id",
        str(uuid.uuid4()),
        "--nnodes",
        "1",
    ]
    if not any(
        o.split("=", 1)[0] in ("--local-addr", "--local_addr") for o in torchrun_options
    ):
        # The address the ranks are told to reach the store at (`MASTER_ADDR`).
        out += ["--local-addr", "127.0.0.1"]
    return out


def static_options(torchrun_options):
    """The user's `torchrun_options` (before the script), with `STATIC` in
    place of torchrun's static rendezvous (`--master-addr`, `--master-port`,
    `--node-rank`): node 0's store bound to the master address."""
    values = {}
    rest = []
    names = {
        "--master-addr": "addr",
        "--master_addr": "addr",
        "--master-port": "port",
        "--master_port": "port",
        "--node-rank": "rank",
        "--node_rank": "rank",
    }
    i = 0
    while i < len(torchrun_options):
        name, has_value, value = torchrun_options[i].partition("=")
        if name in names:
            if not has_value:
                i += 1
                value = torchrun_options[i] if i < len(torchrun_options) else ""
            values[names[name]] = value
        else:
            rest.append(torchrun_options[i])
        i += 1
    endpoint = host_port(
        values.get("addr", _MASTER_ADDR), int(values.get("port", _MASTER_PORT))
    )
    rank = f"rank={values.get('rank', '0')}"
    return ["--rdzv-backend", STATIC, "--rdzv-endpoint", endpoint] + _with_conf(
        rest, rank
    )


def _with_conf(options, entry):
    """`options` with `entry` added to its `--rdzv-conf` (or one made)."""
    out = list(options)
    for i, option in enumerate(out):
        name, has_value, value = option.partition("=")
        if name in ("--rdzv-conf", "--rdzv_conf"):
            if has_value:
                out[i] = f"{name}={value},{entry}" if value else f"{name}={entry}"
            elif i + 1 < len(out):
                out[i + 1] = f"{out[i + 1]},{entry}" if out[i + 1] else entry
            return out
    return ["--rdzv-conf", entry, *out]


def register():
    """Makes `BACKEND` and `STATIC` known to torchrun (in this process;
    idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)
    rendezvous_handler_registry.register(STATIC, create_static_handler)


def create_static_handler(params):
    """torch's static rendezvous for `params` (`RendezvousParameters` of
    `--rdzv-endpoint A:P --rdzv-conf rank=R`): a `StaticTCPRendezvous` whose
    store, on node 0, listens on A only."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    parsed = static_tcp_rendezvous.create_rdzv_handler(params)  # Its checks.

    class BoundStaticRendezvous(static_tcp_rendezvous.StaticTCPRendezvous):
        def get_backend(self):
            return STATIC  # torch's registry checks the name it was asked for.

        def next_rendezvous(self):
            if self.rank == 0 and not self._store:
                # torch would open the server itself, on every interface.
                listener = bound_listener(self.master_addr, self.master_port)
                self._store = TCPStore(
                    self.master_addr,
                    self.master_port,
                    self.world_size,
                    True,
                    self.timeout,
                    multi_tenant=True,
                    master_listen_fd=listener.detach(),
                )
            return super().next_rendezvous()

    return BoundStaticRendezvous(
        parsed.master_addr,
        parsed.master_port,
        int(parsed.rank),  # A string from `--rdzv-conf`; torchrun's own is a number.
        parsed.world_size,
        parsed.run_id,
        int(parsed.timeout.total_seconds()),
    )


def bound_listener(address, port):
    """A TCP socket listening on `address` (a name or IP of this machine)
    at `port`, reused as the engines' servers are (`SO_REUSEADDR`).

    Raises:
        ValueError: no interface of this machine has `address`, or the port
            is taken, naming both.
    """
    errors = []
    for family, kind, protocol, _, where in socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM
    ):
        listener = socket.socket(family, kind, protocol)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(where)
            listener.listen(128)
        except OSError as error:
            listener.close()
            errors.append(error.strerror)
            continue
        return listener
    raise ValueError(
        "node 0 listens at --master-addr, which must be this machine's. "
        f"Received: --master-addr {address} --master-port {port} "
        f"({'; '.join(errors) or 'no address found'}); pass an address of "
        "node 0 and a free port."
    )


def create_handler(params):
    """torch's c10d rendezvous for `params` (`RendezvousParameters` of the
    `--rdzv-*` options): a `DynamicRendezvousHandler` on a store listening on
    127.0.0.1 only, which its ranks share."""
    import torch
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    base = dynamic_rendezvous.DynamicRendezvousHandler
    if not hasattr(base, "_create_tcp_store_server"):
        # Without it torch would open the ranks' store on every interface.
        raise RuntimeError(
            "this torch's rendezvous opens the ranks' store in a way "
            "keras-parallel launch cannot keep on loopback. Received: torch "
            f"{torch.__version__} (no DynamicRendezvousHandler."
            "_create_tcp_store_server); use the torch keras_parallel is tested on (2.13), or pass "
            "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT (every interface)."
        )

    class LoopbackRendezvousHandler(base):
        def _create_tcp_store_server(self, master_addr, master_port):
            # torch would open a second server here, on every interface:
            # the ranks share the rendezvous's own store instead.
            return self._store

        def get_backend(self):
            return BACKEND  # torch's registry checks the name it was asked for.

    read_timeout = params.get_as_int("read_timeout", _READ_TIMEOUT_S)
    listener = loopback_listener()
    port = listener.getsockname()[1]
    store = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        multi_tenant=True,
        timeout=timedelta(seconds=read_timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    backend = C10dRendezvousBackend(store, params.run_id)
    timeouts = {
        name: params.get_as_int(f"{name}_timeout")
        for name in ("join", "last_call", "close", "heartbeat")
    }
    timeout = dynamic_rendezvous.RendezvousTimeout(
        *(None if s is None else timedelta(seconds=s) for s in timeouts.values())
    )
    return LoopbackRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
