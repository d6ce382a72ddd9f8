"""`keras-parallel launch --backend tensorflow`: the workers of one node.

TensorFlow has no coordinator to hand out addresses, so every node computes the
same `TF_CONFIG`: worker `g` (`node_rank * N + i`) is task `g`, worker 0 the
chief, and listens on its node's address at `--master-port + g`.
"""

import json
import os
import sys

from keras_parallel.backends.tensorflow import DEVICES_ENV
from keras_parallel.launcher import local_processes, ports

#: Said once as a one-node launch starts: its servers cannot be bound.
LISTENS_WIDELY = (
    "keras-parallel launch: TensorFlow's workers listen on every interface "
    "of this machine (its gRPC server binds 0.0.0.0, with no option to "
    "bind one address), and what reaches them is trusted. On one machine, "
    "one process with keras_parallel.DataParallel() (MirroredStrategy over "
    "this machine's devices) trains the same and listens on nothing; see "
    'docs/multihost.md, "Network and trust".'
)


def _parser():
    parser = local_processes.parser("tensorflow")
    parser.add_argument("--node-addrs", default=None)
    parser.set_defaults(master_addr=None)
    return parser


def node_addresses(args):
    """Every node's address, in node-rank order.

    Raises:
        ValueError: several nodes without `--node-addrs` or `--master-port`,
            a list of the wrong length, or `--master-addr` not node 0's.
    """
    if args.node_addrs is None:
        if args.nnodes > 1:
            raise ValueError(
                "several TensorFlow nodes need every node's address. Received: "
                f"--nnodes {args.nnodes} without --node-addrs; pass the same "
                "--node-addrs A0,A1,... (node 0 first) and --master-port on "
                "every node."
            )
        return [args.master_addr or "127.0.0.1"]
    addresses = [a.strip() for a in args.node_addrs.split(",") if a.strip()]
    if len(addresses) != args.nnodes:
        raise ValueError(
            "--node-addrs must list one address per node. Received: "
            f"--node-addrs {args.node_addrs} ({len(addresses)} addresses) with "
            f"--nnodes {args.nnodes}; list {args.nnodes} addresses, node 0 first."
        )
    if args.master_addr not in (None, addresses[0]):
        raise ValueError(
            "--master-addr must be node 0's address. Received: --master-addr "
            f"{args.master_addr} and --node-addrs {args.node_addrs}; drop "
            "--master-addr (--node-addrs gives node 0's address)."
        )
    if args.master_port is None and args.nnodes > 1:
        raise ValueError(
            "several TensorFlow nodes need one base port. Received: --nnodes "
            f"{args.nnodes} without --master-port; pass the same --master-port "
            "on every node (worker g listens on --master-port + g)."
        )
    return addresses


def worker_addresses(args, addresses, ports=None):
    """Every worker's `host:port`, in task order.

    `ports`: this node's ports where no `--master-port` was given (one node).
    """
    nproc = args.nproc_per_node
    out = []
    for node, address in enumerate(addresses):
        for local in range(nproc):
            g = node * nproc + local
            port = ports[local] if ports else args.master_port + g
            out.append(f"{address}:{port}")
    return out


def commands(args, workers, base_env=None):
    """One `(argv, env)` per worker of this node, in worker order.

    `workers` is `worker_addresses`; `base_env` (default `os.environ`) is the
    environment to start from.
    """
    base = dict(os.environ if base_env is None else base_env)
    nproc = args.nproc_per_node
    out = []
    for local in range(nproc):
        task = {"type": "worker", "index": args.node_rank * nproc + local}
        env = dict(
            base,
            KERAS_BACKEND="tensorflow",
            TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": task}),
        )
        if args.devices_per_process:
            env[DEVICES_ENV] = str(args.devices_per_process)
            env.setdefault("OMP_NUM_THREADS", local_processes.cpu_threads(nproc))
        out.append((local_processes.bootstrap_argv(args), env))
    return out


def main(argv):
    """Parses, checks, starts and supervises; returns the exit status."""
    args = local_processes.parse(_parser(), argv)
    local_processes.give_one_node_a_secret(args)
    addresses = node_addresses(args)
    here = addresses[args.node_rank]
    free = None
    if args.master_port is None:
        free = _free_ports(here, args.nproc_per_node)
    workers = worker_addresses(args, addresses, free)
    first = args.node_rank * args.nproc_per_node
    for g in range(first, first + args.nproc_per_node):
        port = int(workers[g].rsplit(":", 1)[1])
        ports.check_port_free(here, port, role=f"worker {g}")
    if args.nnodes == 1:
        print(LISTENS_WIDELY, file=sys.stderr, flush=True)
    if free is None:
        return local_processes.run(commands(args, workers), args, label="worker")

    def attempt(number):
        # Fresh ports per attempt: the last workers' servers may linger.
        if number:
            free[:] = _free_ports(here, args.nproc_per_node)
        return commands(args, worker_addresses(args, addresses, free))

    return local_processes.run(attempt, args, label="worker")


def _free_ports(address, count):
    """`count` distinct free ports on `address`."""
    found = []
    while len(found) < count:
        port = ports.free_port(address)
        if port not in found:
            found.append(port)
    return found
