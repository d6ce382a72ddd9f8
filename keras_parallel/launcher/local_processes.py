"""The options and checks `keras-parallel launch` shares for JAX and TensorFlow.

Both start this node's processes through `bootstrap` under `supervisor`; only
each process's environment differs.
"""

import argparse
import os
import sys

from keras_parallel.launcher import supervisor
from keras_parallel.launcher.checks import check_positive, check_script


def parser(backend):
    """The options of `keras-parallel launch --backend <backend>`.

    The caller may add options to the returned `argparse.ArgumentParser`.
    """
    out = argparse.ArgumentParser(prog=f"keras-parallel launch --backend {backend}")
    out.add_argument("--nproc-per-node", "--nproc", type=int, default=1)
    out.add_argument("--nnodes", type=int, default=1)
    out.add_argument("--node-rank", type=int, default=0)
    out.add_argument("--master-addr", default="127.0.0.1")
    out.add_argument("--master-port", type=int, default=None)
    out.add_argument("--devices-per-process", type=int, default=None)
    out.add_argument("--max-restarts", type=int, default=0)
    return out


def parse(option_parser, argv):
    """Parses `argv` (options, script, script args) and checks the options.

    Raises:
        ValueError: a count below 1, a node rank out of range, no script.
    """
    option_parser.add_argument("script", nargs="?")
    option_parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = option_parser.parse_args(argv)
    check_positive("--nproc-per-node", args.nproc_per_node)
    check_positive("--nnodes", args.nnodes)
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(
            f"--node-rank must be in [0, {args.nnodes}). Received: --node-rank "
            f"{args.node_rank} with --nnodes {args.nnodes}."
        )
    if args.devices_per_process is not None:
        check_positive("--devices-per-process", args.devices_per_process)
    if args.max_restarts < 0:
        raise ValueError(
            "--max-restarts must be 0 or more. Received: --max-restarts "
            f"{args.max_restarts}; pass e.g. --max-restarts 3."
        )
    check_script(args.script, argv)
    return args


def bootstrap_argv(args):
    """The command line of one process: the bootstrap, then the script."""
    return [
        sys.executable,
        "-m",
        "keras_parallel.launcher.bootstrap",
        args.script,
        *args.script_args,
    ]


def cpu_threads(nproc):
    """Each process's share of this node's cores (for simulated CPU devices)."""
    return str(max(1, (os.cpu_count() or 1) // nproc))


def give_one_node_a_secret(args):
    """Puts a new run secret in this launcher's environment, which every
    process it starts inherits, for a launch of one node (several nodes'
    launchers cannot agree on one: the user gives it, `run_secret`)."""
    from keras_parallel.messages import run_secret

    if args.nnodes == 1:
        os.environ.update(run_secret.for_children())


def run(commands, args, label="process"):
    """Starts and supervises the processes; returns the launcher's exit status.

    `commands` and `label` are as in `supervisor.supervise`.
    """
    return supervisor.supervise(commands, label=label, max_restarts=args.max_restarts)
