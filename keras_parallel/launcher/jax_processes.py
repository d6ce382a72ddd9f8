"""`keras-parallel launch --backend jax`: the processes of one node.

Each gets the variables `keras.distribution.initialize()` reads and runs
`bootstrap`; process `node_rank * N + i` runs on node `node_rank`, and
process 0 hosts the coordinator.
"""

import os

from keras_parallel.backends.jax import runtime
from keras_parallel.cluster_environments.base import HELD_PORT_VAR, host_port
from keras_parallel.launcher import local_processes, ports


def commands(args, base_env=None, held_port=False):
    """One `(argv, env)` per process of this node, in process order.

    `base_env` (default `os.environ`) is the environment to start from;
    `held_port`: the launcher holds `--master-port` for process 0's
    coordinator (`ports.hold_free_port`), which its port check then allows.
    """
    base = dict(os.environ if base_env is None else base_env)
    nproc, nnodes = args.nproc_per_node, args.nnodes
    port = args.master_port
    # JAX's coordination service binds every interface (`[::]`) unless told:
    # the address the processes reach it at is the one interface it needs.
    bind = host_port(args.master_addr, port)
    out = []
    for local in range(nproc):
        env = {
            **base,
            "KERAS_BACKEND": "jax",
            runtime.ADDRESS_ENV: f"{args.master_addr}:{port}",
            runtime.COUNT_ENV: str(nproc * nnodes),
            runtime.ID_ENV: str(args.node_rank * nproc + local),
            "JAX_COORDINATOR_BIND_ADDRESS": bind,
        }
        if held_port:
            env[HELD_PORT_VAR] = str(port)
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
    local_processes.give_one_node_a_secret(args)
    if args.nnodes == 1:
        ports.check_local_address(args.master_addr)
        ports.warn_if_gloo_reachable("keras-parallel launch")
    if args.master_port is None:
        if args.nnodes > 1:
            raise ValueError(
                "several nodes need one coordinator port. Received: --nnodes "
                f"{args.nnodes} without --master-port; pass the same "
                "--master-addr and --master-port on every node."
            )

        held = []

        def attempt(number):
            # A fresh port per attempt (the last coordinator's may linger),
            # held for process 0's coordinator while the attempt runs
            # (`ports.hold_free_port`): no other user takes it in between.
            while held:
                held.pop().close()
            held.append(ports.hold_free_port(args.master_addr))
            args.master_port = held[0].getsockname()[1]
            return commands(args, held_port=True)

        try:
            return local_processes.run(attempt, args)
        finally:
            while held:
                held.pop().close()
    if args.node_rank == 0:
        ports.check_port_free(args.master_addr, args.master_port)
    return local_processes.run(commands(args), args)
