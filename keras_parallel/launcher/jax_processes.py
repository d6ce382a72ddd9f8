"""`keras-parallel launch --backend jax`: the processes of one node.

Each process gets the environment `keras.distribution.initialize()` reads, runs
`bootstrap` (which starts `jax.distributed` before the script) and is
supervised with the others. Process `node_rank * N + i` runs on node
`node_rank`; process 0 hosts the coordinator. The options and their checks are
shared with TensorFlow (`local_processes`).
"""

import os

from keras_parallel.backends.jax import runtime
from keras_parallel.launcher import local_processes, ports


def commands(args, base_env=None):
    """One `(argv, env)` per process of this node.

    Args:
        args: the parsed options (see `local_processes.parser`).
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
            env.setdefault("OMP_NUM_THREADS", local_processes.cpu_threads(nproc))
        out.append((local_processes.bootstrap_argv(args), env))
    return out


def main(argv):
    """Parses, checks, starts and supervises; returns the exit status."""
    args = local_processes.parse(local_processes.parser("jax"), argv)
    if args.master_port is None:
        if args.nnodes > 1:
            raise ValueError(
                "several nodes need one coordinator port. Received: --nnodes "
                f"{args.nnodes} without --master-port; pass the same "
                "--master-addr and --master-port on every node."
            )

        def attempt(number):
            # A fresh port per attempt: the last coordinator's may linger.
            args.master_port = ports.free_port(args.master_addr)
            return commands(args)

        return local_processes.run(attempt, args)
    if args.node_rank == 0:
        ports.check_port_free(args.master_addr, args.master_port)
    return local_processes.run(commands(args), args)
