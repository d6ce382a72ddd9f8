"""`keras-parallel launch --backend jax`: the processes of one node.

Each process gets the environment `keras.distribution.initialize()` reads
(the coordinator's address, the process count, its process id), runs
`keras_parallel.launcher.bootstrap` (which starts `jax.distributed` before
the user's script runs) and is supervised with the others
(`keras_parallel.launcher.supervisor`). Process `node_rank * N + i` runs on
node `node_rank`; process 0 (node 0) hosts the coordinator.

On a machine without accelerators, `--devices-per-process K` gives each
process K simulated CPU devices, connected over gloo.
"""

import argparse
import os
import sys

from keras_parallel.backends.jax import runtime
from keras_parallel.launcher import supervisor
from keras_parallel.launcher.cli import check_positive, check_script
from keras_parallel.launcher.processes import free_port


def _parser():
    parser = argparse.ArgumentParser(prog="keras-parallel launch --backend jax")
    parser.add_argument("--nproc-per-node", "--nproc", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=None)
    parser.add_argument("--devices-per-process", type=int, default=None)
    parser.add_argument("script", nargs="?")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def commands(args, base_env=None):
    """One `(argv, env)` per process of this node.

    Args:
        args: the parsed options (see `_parser`).
        base_env: the environment to start from; defaults to `os.environ`.

    Returns:
        A list of `(argv, env)`, in process order.
    """
    base = dict(os.environ if base_env is None else base_env)
    nproc, nnodes = args.nproc_per_node, args.nnodes
    port = args.master_port
    out = []
    for local in range(nproc):
        env = dict(
            base,
            KERAS_BACKEND="jax",
            **{
                runtime.ADDRESS_ENV: f"{args.master_addr}:{port}",
                runtime.COUNT_ENV: str(nproc * nnodes),
                runtime.ID_ENV: str(args.node_rank * nproc + local),
            },
        )
        if args.devices_per_process:
            flags = [
                f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
            ]
            flags.append(
                f"--xla_force_host_platform_device_count={args.devices_per_process}"
            )
            env["XLA_FLAGS"] = " ".join(flags)
            env["JAX_PLATFORMS"] = "cpu"
            # Each process's share of the cores, not all of them each.
            threads = max(1, (os.cpu_count() or 1) // nproc)
            env.setdefault("OMP_NUM_THREADS", str(threads))
        argv = [sys.executable, "-m", "keras_parallel.launcher.bootstrap"]
        out.append((argv + [args.script, *args.script_args], env))
    return out


def main(argv):
    """Parses, checks, starts and supervises; returns the exit status."""
    args = _parser().parse_args(argv)
    check_positive("--nproc-per-node", args.nproc_per_node)
    check_positive("--nnodes", args.nnodes)
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(
            f"--node-rank must be in [0, {args.nnodes}). Received: --node-rank "
            f"{args.node_rank} with --nnodes {args.nnodes}."
        )
    if args.devices_per_process is not None:
        check_positive("--devices-per-process", args.devices_per_process)
    check_script(args.script, argv)
    if args.master_port is None:
        if args.nnodes > 1:
            raise ValueError(
                "several nodes need one coordinator port. Received: --nnodes "
                f"{args.nnodes} without --master-port; pass the same "
                "--master-addr and --master-port on every node."
            )
        args.master_port = free_port(args.master_addr)
    elif args.node_rank == 0:
        _check_port_free(args.master_addr, args.master_port)
    return supervisor.supervise(commands(args))


def _check_port_free(address, port):
    """Refuses a coordinator port that something on this node already holds."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError as error:
            raise ValueError(
                f"the coordinator port is taken. Received: --master-addr "
                f"{address} --master-port {port} ({error.strerror}); pass a "
                "free --master-port, or none on one node for a free one."
            ) from None
