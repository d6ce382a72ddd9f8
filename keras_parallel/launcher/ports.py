"""Ports on this node: a free one to listen on, or a refusal to start on a taken one."""

import os
import random
import socket

from keras_parallel.cluster_environments.base import bind_error

#: Where `free_port` looks: above the ports services register, below the
#: kernel's ephemeral range (read from Linux; IANA's 49152 elsewhere).
LOWEST_CHOSEN_PORT = 10000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: The operating system's randomness, not `random`'s shared generator:
#: `keras.utils.set_random_seed` seeds that one, and two runs seeded
#: alike chose the same ports, one after the other, and collided.
_CHOOSER = random.SystemRandom()


def _ephemeral_low():
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def free_port(host="127.0.0.1"):
    """A TCP port nobody listens on now (for `MASTER_PORT`).

    Chosen at random below the kernel's ephemeral range: a port the kernel
    hands out (an outgoing connection's, another program's `bind(0)`) could
    be taken by anything on the machine between this choice and the
    coordinator's bind, and was (two runs side by side). Below that range
    only a program that names the port takes it.

    Args:
        host: the address to check the port on.

    Returns:
        The port, free on `host` when checked.
    """
    high = max(_ephemeral_low(), LOWEST_CHOSEN_PORT + 1000)
    for _ in range(200):
        port = _CHOOSER.randrange(LOWEST_CHOSEN_PORT, high)
        if bind_error(host, port) is None:
            return port
    # Every try taken (a crowded machine): the kernel's choice.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def hold_free_port(host="127.0.0.1"):
    """A free port on `host` (where the server will bind), held for this
    user's server: the bound `socket.socket` (its port: `getsockname()[1]`),
    to close once the server is up or the run ended.

    The socket is bound with `SO_REUSEPORT` and does not listen: the kernel
    then refuses the port to every other bind (a program without
    `SO_REUSEPORT`, or another user's with it) while a gRPC server of this
    user, which binds with `SO_REUSEPORT` (JAX's coordinator), takes it.
    No other local user can take the port between its choice and the
    server's bind. (TensorFlow's gRPC servers bind without `SO_REUSEPORT`:
    their ports cannot be held this way.)
    """
    high = max(_ephemeral_low(), LOWEST_CHOSEN_PORT + 1000)
    for _ in range(200):
        port = _CHOOSER.randrange(LOWEST_CHOSEN_PORT, high)
        if bind_error(host, port) is not None:
            continue  # Listened on, or left in TIME-WAIT by another program.
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            holder.bind((host, port))
        except OSError:
            holder.close()
            continue
        return holder
    raise OSError(
        f"no free port to hold on {host}: 200 ports tried between "
        f"{LOWEST_CHOSEN_PORT} and {high}; pass --master-port with a free one."
    )


def loopback_listener():
    """A TCP socket listening on 127.0.0.1 at a free port, held open.

    Handed to a server (`TCPStore(master_listen_fd=...)`), it keeps the
    server on loopback (torch's store binds every interface when it opens
    its own socket) and the port ours from the start: no other process can
    take it between choosing and binding.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def gloo_on_loopback():
    """Environment variables (`{name: value}`) that keep torch's gloo
    sockets on loopback.

    torch's gloo listens on the address this machine's host name resolves
    to; `GLOO_SOCKET_IFNAME` names the interface instead. Empty where the
    user set it (kept) or no loopback interface is found.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    names = {name for _, name in socket.if_nameindex()}
    for name in ("lo", "lo0"):  # Linux, macOS and the BSDs.
        if name in names:
            return {"GLOO_SOCKET_IFNAME": name}
    return {}


def host_name_address():
    """The address this machine's host name resolves to (where an engine
    that is given no interface listens), or None if it does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def warn_if_gloo_reachable(who, resolve=host_name_address):
    """Says once, on stderr, that JAX's gloo collectives will listen beyond
    loopback: JAX gives gloo no interface, and gloo listens where the host
    name resolves (`resolve`: a test's stand-in). `who` is the launcher, for
    the message. Returns whether it warned.
    """
    import ipaddress
    import sys

    address = resolve()
    try:
        if address is None or ipaddress.ip_address(address).is_loopback:
            return False
    except ValueError:
        return False
    print(
        f"{who}: warning: JAX's gloo collectives (CPU processes) listen on "
        f"{address}, where this machine's host name resolves, not on loopback: "
        "JAX gives gloo no interface to bind. Anyone who can reach that address "
        "can connect to them; on a shared network, map the host name to "
        "127.0.0.1 (/etc/hosts) or firewall the ports.",
        file=sys.stderr,
        flush=True,
    )
    return True


def check_local_address(address):
    """Refuses (`ValueError`) an address no interface of this machine has.

    A launch of one node listens at `--master-addr`: an address of another
    machine (or none) would fail later, inside the engine, with less clear
    words.
    """
    try:
        found = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        found = []
    for family, kind, protocol, _, where in found:
        with socket.socket(family, kind, protocol) as probe:
            try:
                probe.bind(where)
            except OSError:
                continue
            return
    raise ValueError(
        "--master-addr is not an address of this machine, and a launch of "
        f"one node listens there. Received: --master-addr {address} with "
        "--nnodes 1; leave it out (127.0.0.1: nothing off this machine can "
        "reach the run), or pass one of this machine's addresses."
    )


def check_port_free(address, port, role="coordinator"):
    """Refuses (`ValueError`) a port something on this node already listens on.

    `role` names what will listen there, for the message (`"worker 1"`).
    """
    error = bind_error(address, port)
    if error is not None:
        raise ValueError(
            f"the {role} port is taken. Received: port {port} on "
            f"{address} ({error.strerror}); pass a free --master-port, "
            "or none on one node for free ports."
        )
