"""torchrun's one-node rendezvous, with every store on 127.0.0.1.

`torchrun --standalone` opens two `TCPStore` servers in the launching
process: the c10d rendezvous's, and the one the ranks share
(`MASTER_PORT`). A `TCPStore` server binds every interface whatever host
name it is given, so any host that reaches this machine could join the
group. Here the rendezvous's store listens on a socket of ours bound to
loopback (`ports.loopback_listener`), and the ranks share that same store:
the launch listens on one port, on 127.0.0.1 only.

It is registered with torch's rendezvous registry (its documented way to
add a rendezvous) under `BACKEND`, and `keras-parallel launch` passes it in
place of `--standalone` (`options`).
"""

import os
import socket
import uuid
from datetime import timedelta

from keras_parallel.launcher.ports import loopback_listener

#: The name torchrun's `--rdzv-backend` knows it by.
BACKEND = "keras-parallel-loopback"
#: torch's own default for the c10d store's reads (`read_timeout`).
_READ_TIMEOUT_S = 60


def options(torchrun_options):
    """torchrun's options for a one-node run on loopback, in place of
    `--standalone`.

    Args:
        torchrun_options: the user's options (before the script), which may
            give `--local-addr` (kept: it must be this machine's loopback).

    Returns:
        A list of torchrun options.
    """
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


def ranks_environment():
    """Environment variables that keep the ranks' gloo sockets on loopback.

    torch's gloo listens on the address this machine's host name resolves
    to; `GLOO_SOCKET_IFNAME` names the interface instead. An interface the
    user set is kept.

    Returns:
        `{name: value}`, empty where the user set it or no loopback
        interface is found.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    names = {name for _, name in socket.if_nameindex()}
    for name in ("lo", "lo0"):  # Linux, macOS and the BSDs.
        if name in names:
            return {"GLOO_SOCKET_IFNAME": name}
    return {}


def register():
    """Makes `BACKEND` known to torchrun (in this process; idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)


def create_handler(params):
    """torch's c10d rendezvous, on a store listening on 127.0.0.1 only.

    Args:
        params: torch's `RendezvousParameters` (the `--rdzv-*` options).

    Returns:
        A `DynamicRendezvousHandler` whose ranks share its store.
    """
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
            f"{_torch_version()} (no DynamicRendezvousHandler."
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


def _torch_version():
    import torch

    return torch.__version__
