"""Ports on this node: a free one to listen on, or a refusal to start on a taken one."""

import socket


def free_port(host="127.0.0.1"):
    """A TCP port nobody listens on now (for `MASTER_PORT`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(address, port, role="coordinator"):
    """Refuses a port that something on this node already listens on.

    Args:
        address: the address the process will listen on.
        port: the port.
        role: what listens there, for the message (`"coordinator"`,
            `"worker 1"`).

    Raises:
        ValueError: naming the port and the fix.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Bind as the engines' servers will (gRPC's listeners for TensorFlow's
        # workers and JAX's coordinator, libuv's for torch's store all set
        # SO_REUSEADDR): a port whose last run left only TIME-WAIT
        # connections is free to them, while one that something listens on
        # is still refused. A plain bind refuses both, for about 60 s.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as error:
            raise ValueError(
                f"the {role} port is taken. Received: port {port} on "
                f"{address} ({error.strerror}); pass a free --master-port, "
                "or none on one node for free ports."
            ) from None
