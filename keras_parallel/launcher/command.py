"""`keras-parallel launch`: one command for every backend.

The backend is `--backend`, else `KERAS_BACKEND`.

- torch: `torchrun` (`torch.distributed.run`) by another name. `--nproc N`
  is `--nproc-per-node N`, and `--standalone` (a free local port) is added
  when no rendezvous option is given; every other torchrun option passes
  through, so its restart and rendezvous options work.
- JAX: N processes of this node, each with the environment
  `keras.distribution.initialize()` reads, started through
  `keras_parallel.launcher.bootstrap` (the runtime is up before the script
  runs) and supervised by `keras_parallel.launcher.supervisor`.
- TensorFlow: the same, each worker with a `TF_CONFIG` (see
  `tf_processes`); the bootstrap creates the `MultiWorkerMirroredStrategy`.
"""

import os
import sys

from keras_parallel.launcher.checks import check_positive, check_script

_USAGE = (
    "usage: keras-parallel launch [--backend B] [--nproc-per-node N] "
    "[--nnodes M --node-rank R --master-addr A --master-port P] "
    "[--devices-per-process K] [--max-restarts R] script.py [script args]\n\n"
    "Runs script.py in N processes per node, on the backend B (default: "
    "$KERAS_BACKEND). torch: through torch.distributed.run (torchrun); every "
    "torchrun option works. jax: through jax.distributed; tensorflow: "
    "through tf.distribute.MultiWorkerMirroredStrategy (several nodes: "
    "--node-addrs A0,A1,... and --master-port P; worker g listens on P + g). "
    "--devices-per-process K simulates K CPU devices per process. "
    "--max-restarts R: a failed group is ended and started again, up to R "
    "times (with keras.callbacks.BackupAndRestore, training goes on from "
    "the last backup)."
)
BACKENDS = ("jax", "tensorflow", "torch")

#: The options that choose a rendezvous; without any, `launch` CLI runs
#: torchrun `--standalone` (a free local port).
_RENDEZVOUS_OPTIONS = (
    "--standalone",
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-backend",
    "--rdzv_backend",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
)


def main(argv=None):
    """`keras-parallel launch [--nproc N] [torchrun options] script [args]`.

    A thin layer over `torch.distributed.run` (torchrun): `--nproc N` is
    `--nproc-per-node N`, and `--standalone` is added when no rendezvous
    option is given. Every other torchrun option passes through.

    Args:
        argv: the arguments after `launch`.

    Returns:
        The exit status: 0; the failed rank's exit code (1 if it was
        killed by a signal); 2 for a command that cannot start.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        try:
            from torch.distributed import run
        except ImportError:
            print(
                "\ntorch is not installed, so its options cannot be listed: "
                "pip install 'keras-parallel[torch]'."
            )
            return 0
        print("torchrun's own help follows.\n")
        run.get_args_parser().print_help()
        return 0
    try:
        backend, argv = _backend(argv)
        if backend == "jax":
            from keras_parallel.launcher import jax_processes

            return jax_processes.main(argv)
        if backend == "tensorflow":
            from keras_parallel.launcher import tf_processes

            return tf_processes.main(argv)
        torchrun_args, script = _torchrun_args(argv)
        _check(torchrun_args, script)
        torchrun_args = _through_bootstrap(torchrun_args, script)
        os.environ["KERAS_BACKEND"] = "torch"
        from torch.distributed import run
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except (ValueError, ImportError) as error:
        print(f"keras-parallel launch: error: {_message(error)}", file=sys.stderr)
        return 2
    try:
        run.run(run.parse_args(torchrun_args))
    except ChildFailedError as error:
        rank, failure = _first_cause(error)
        print(
            f"keras-parallel launch: rank {rank} failed with exit code "
            f"{failure.exitcode} (its traceback is above).",
            file=sys.stderr,
        )
        # The rank's own exit code (sys.exit(3) gives 3); a signal, 1.
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def _through_bootstrap(torchrun_args, script):
    """Runs the script through `keras_parallel.launcher.bootstrap` (`-m`)."""
    modes = {"-m", "--module", "--no-python", "--no_python"}
    if modes.intersection(torchrun_args):
        return torchrun_args  # The user's own module or program.
    at = torchrun_args.index(script)
    return (
        torchrun_args[:at]
        + ["-m", "keras_parallel.launcher.bootstrap"]
        + (torchrun_args[at:])
    )


def _first_cause(error):
    """The rank that failed first, not one that stopped because of it.

    torchrun orders failures by a timestamp of whole seconds. A rank that
    raised `PeerFailedError` (its error file says so) stopped because of
    another, and so did a rank ended by a signal (torchrun sends SIGTERM to
    the rest once one fails): both come after a rank that exited by itself.
    """
    failures = error.failures

    def order(rank):
        failure = failures[rank]
        peer = "PeerFailedError" in str(failure.message)
        return (peer, failure.exitcode < 0, failure.timestamp, rank)

    rank = min(failures, key=order)
    return rank, failures[rank]


def _backend(argv):
    """The backend (`--backend`, else `$KERAS_BACKEND`) and the other args."""
    rest = list(argv)
    backend = None
    for i, arg in enumerate(rest):
        if not arg.startswith("-"):
            break  # The script: what follows is its own.
        if arg == "--backend" and i + 1 < len(rest):
            backend = rest[i + 1]
            del rest[i : i + 2]
            break
        if arg.startswith("--backend="):
            backend = arg.split("=", 1)[1]
            del rest[i]
            break
    backend = backend or os.environ.get("KERAS_BACKEND")
    if backend not in BACKENDS:
        raise ValueError(
            "keras-parallel launch starts processes for the jax, tensorflow "
            f"and torch backends. Received: backend {backend!r} (from "
            "--backend or KERAS_BACKEND); pass --backend jax, --backend "
            "tensorflow or --backend torch, or set KERAS_BACKEND."
        )
    return backend, rest


def _message(error):
    if isinstance(error, ImportError):
        return (
            "it runs processes with torch.distributed.run, and torch is not "
            f"installed. Received: {error}; pip install 'keras-parallel[torch]'."
        )
    return str(error)


def _check(torchrun_args, script):
    """Refuses a launch that would fail in every process, before it starts."""
    for i, arg in enumerate(torchrun_args):
        name, _, value = arg.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            value = value or (
                torchrun_args[i + 1] if i + 1 < len(torchrun_args) else ""
            )
            if value.isdigit():
                check_positive("--nproc", int(value))
    modes = {"-m", "--module", "--no-python", "--no_python"}
    check_script(script, torchrun_args, is_path=not modes.intersection(torchrun_args))


def _torchrun_args(argv):
    out = []
    i = 0
    script_at = None
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc" and i + 1 < len(argv):
            out += ["--nproc-per-node", argv[i + 1]]
            i += 2
            continue
        if arg.startswith("--nproc="):
            out.append("--nproc-per-node=" + arg.split("=", 1)[1])
        elif not arg.startswith("-") and (not out or not _takes_value(out[-1])):
            script_at = len(out)
            out += argv[i:]
            break
        else:
            out.append(arg)
        i += 1
    options = out if script_at is None else out[:script_at]
    script = None if script_at is None else out[script_at]
    if not any(o.split("=", 1)[0] in _RENDEZVOUS_OPTIONS for o in options):
        out.insert(0, "--standalone")
    return out, script


def _takes_value(option):
    # torchrun options that are flags; every other option takes a value.
    flags = {
        "--standalone",
        "--no-python",
        "--no_python",
        "--run-path",
        "--run_path",
        "-m",
        "--module",
    }
    return option.startswith("-") and "=" not in option and option not in flags
