"""`keras-parallel launch --backend tensorflow`: the workers of one node.

TensorFlow has no coordinator to hand out addresses, so every node computes the
same `TF_CONFIG`: worker `g` (`node_rank * N + i`) is task `g`, worker 0 the
chief, and listens on its node's address at `--master-port + g`.

A worker's gRPC server binds every interface and runs what reaches it. On
one machine, one process (`MirroredStrategy` over the machine's devices)
trains the same and starts no server, so that is the default: one process
of one node gets no `TF_CONFIG`, and several workers on one machine are an
explicit choice (`--allow-reachable-workers`), warned as they start.
"""

import json
import os
import sys

from keras_parallel.backends.tensorflow import DEVICES_ENV
from keras_parallel.launcher import local_processes, ports

#: The option that starts several workers on one machine anyway.
ALLOW_OPTION = "--allow-reachable-workers"

#: Said once as a launch of workers starts: their servers cannot be bound.
LISTENS_WIDELY = (
    "keras-parallel launch: warning: TensorFlow's workers are reachable from "
    "the network: anyone who can connect can run code in these processes "
    "(each worker's gRPC server binds every interface of this machine, "
    "0.0.0.0, with no option to bind one address, and trusts what reaches "
    "it). On one machine, one process with keras_parallel.DataParallel() "
    "(MirroredStrategy over this machine's devices, the launch's default) "
    "trains the same and listens on nothing; see docs/multihost.md, "
    '"Network and trust".'
)


def _parser():
    parser = local_processes.parser("tensorflow")
    parser.add_argument("--node-addrs", default=None)
    parser.add_argument(ALLOW_OPTION, action="store_true")
    parser.set_defaults(master_addr=None)
    return parser


def check_one_machine(args):
    """Refuses several workers on one machine unless asked for by name.

    Raises:
        ValueError: `--nproc-per-node` over 1 on one node without
            `--allow-reachable-workers`.
    """
    if (
        args.nnodes == 1
        and args.nproc_per_node > 1
        and not args.allow_reachable_workers
    ):
        raise ValueError(
            "several TensorFlow workers on one machine are reachable from the "
            "network: anyone who can connect can run code in these processes "
            "(TensorFlow's gRPC servers bind every interface). Received: "
            f"--nproc-per-node {args.nproc_per_node} on one node; run one "
            "process instead (drop --nproc-per-node: keras_parallel."
            "DataParallel() trains over every device of this machine through "
            "MirroredStrategy, with no server; --devices-per-process K splits "
            f"the CPU into K devices), or pass {ALLOW_OPTION} to start the "
            "workers anyway."
        )


def one_process(args, base_env=None):
    """The one process of a one-node launch without workers: no `TF_CONFIG`
    (no server), the machine's devices (`--devices-per-process` CPU devices
    where given)."""
    env = dict(os.environ if base_env is None else base_env)
    env["KERAS_BACKEND"] = "tensorflow"
    env.pop("TF_CONFIG", None)
    if args.devices_per_process:
        env[DEVICES_ENV] = str(args.devices_per_process)
    return [(local_processes.bootstrap_argv(args), env)]


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
    check_one_machine(args)
    local_processes.give_one_node_a_secret(args)
    if args.nnodes == 1 and args.nproc_per_node == 1:
        return local_processes.run(one_process(args), args, label="worker")
    addresses = node_addresses(args)
    here = addresses[args.node_rank]
    free = _free_ports(here, args.nproc_per_node) if args.master_port is None else None
    workers = worker_addresses(args, addresses, free)
    first = args.node_rank * args.nproc_per_node
    for g in range(first, first + args.nproc_per_node):
        port = int(workers[g].rsplit(":", 1)[1])
        ports.check_port_free(here, port, role=f"worker {g}")
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
