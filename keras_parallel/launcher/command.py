"""`keras-parallel launch`: one command for every backend.

On torch it is torchrun by another name; on JAX and TensorFlow it starts this
node's processes through `bootstrap` and supervises them (docs/multihost.md).
"""

import contextlib
import logging
import os
import signal
import sys
import tempfile

from keras_parallel import keras_config
from keras_parallel.launcher import bootstrap, parent_death, supervisor
from keras_parallel.launcher.checks import check_positive, check_script
from keras_parallel.messages import run_secret
from keras_parallel.run import stall_settings

_USAGE = (
    "usage: keras-parallel launch [--backend B] [--nproc N] "
    "[--nnodes M --node-rank R --master-addr A --master-port P] "
    "[--devices-per-process K] [--max-restarts R] [--stall-timeout S] "
    "script.py [script args]\n\n"
    "Runs script.py in N processes per node (--nproc N, or "
    "--nproc-per-node N), on the backend B (default: the one Keras would "
    "use: $KERAS_BACKEND, else keras.json, else tensorflow). torch: "
    "through torch.distributed.run (torchrun); every "
    "torchrun option works. jax: through jax.distributed; tensorflow: "
    "one process on one machine (MirroredStrategy over its devices, no "
    "server), else through tf.distribute.MultiWorkerMirroredStrategy, "
    "whose workers are reachable from the network (several on one machine: "
    "--allow-reachable-workers; several nodes: --node-addrs A0,A1,... and "
    "--master-port P; worker g listens on P + g). "
    "--devices-per-process K simulates K CPU devices per process. "
    "--max-restarts R: a failed group is ended and started again, up to R "
    "times (with keras.callbacks.BackupAndRestore, training goes on from "
    "the last backup). --stall-timeout S: a process that has not finished "
    "a step for S seconds while the others wait for it is named with its "
    "stack, and every process ends with exit code 77 (default 240; 0: off; "
    "sets KERAS_PARALLEL_STALL_TIMEOUT)."
)
BACKENDS = ("jax", "tensorflow", "torch")
#: torchrun's words for `--nproc-per-node`: one process per device of a kind.
_DEVICE_COUNTS = ("auto", "cpu", "gpu", "xpu")

#: torchrun's options that run a module or a program, not a script's path.
_PROGRAM_OPTIONS = {"-m", "--module", "--no-python", "--no_python"}
#: Options that choose a rendezvous; without any, torchrun runs `--standalone`.
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
    """`keras-parallel launch [--backend B] [--nproc N] [options] script [args]`.

    On torch, `--nproc N` is `--nproc-per-node N`; with no rendezvous
    option (or `--standalone`) the run's stores and ranks listen on
    127.0.0.1 only, and node 0's store of several nodes on `--master-addr`
    only; every other option passes through.

    Args:
        argv: the arguments after `launch`.

    Returns:
        The exit status: 0; the failed rank's exit code (1 if a signal killed
        it; 77 when one stalled); 2 for a command that cannot start; 128 +
        the signal's number when SIGINT or SIGTERM stopped the launch.
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
        argv = stall_settings.take_stall_timeout_option(argv)
        if backend == "jax":
            from keras_parallel.launcher import jax_processes

            return jax_processes.main(argv)
        if backend == "tensorflow":
            from keras_parallel.launcher import tf_processes

            return tf_processes.main(argv)
        torchrun_args, script = _torchrun_args(argv)
        _check(torchrun_args, script)
        torchrun_args = _signals_left_to_launcher(torchrun_args, script)
        torchrun_args = _through_bootstrap(torchrun_args, script)
        torchrun_args = _bound_rendezvous(torchrun_args, script)
        if _option_value(torchrun_args, ("--nnodes",), "1") in ("1", "1:1"):
            # One node: a run secret of its own, inherited by every rank
            # (several nodes' launchers cannot agree on one: `run_secret`).
            os.environ.update(run_secret.for_children())
        os.environ["KERAS_BACKEND"] = "torch"
        from torch.distributed import run
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except (ValueError, ImportError) as error:
        print(f"keras-parallel launch: error: {_message(error)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="keras_parallel-preempted-") as marks:
        # Each rank a preemption stopped leaves a file here (`bootstrap`):
        # torchrun, stopped by the same signal, reports no rank's exit code.
        os.environ[bootstrap.PREEMPTED_MARKS_ENV] = marks
        # torchrun's agent runs here: the ranks are this process's children.
        parent_death.mark_launcher(os.environ)
        code = _run_torchrun(run, torchrun_args, SignalException, ChildFailedError)
        if code != 0 and _every_rank_preempted(marks, torchrun_args):
            print(
                "keras-parallel launch: preempted: every rank stopped at the "
                "same step (exit code 75); run the same command to resume "
                "from its backup.",
                file=sys.stderr,
            )
            return bootstrap.PREEMPTED_EXIT_CODE
        return code


def _bound_rendezvous(torchrun_args, script):
    """`torchrun_args`, with torchrun's own rendezvous (whose store listens
    on every interface) replaced by one listening where the run asks only
    (`bound_rendezvous`): `--standalone` on 127.0.0.1; the static
    rendezvous of `--master-addr A` on A. A rendezvous the user named
    (`--rdzv-backend`, `--rdzv-endpoint`) is left as it is.
    """
    at = torchrun_args.index(script)
    options = torchrun_args[:at]
    from keras_parallel.launcher import bound_rendezvous, ports

    if "--standalone" in options:
        bound_rendezvous.register()
        os.environ.update(ports.gloo_on_loopback())
        options = [o for o in options if o != "--standalone"]
        return bound_rendezvous.loopback_options(options) + options + torchrun_args[at:]
    named = {"--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint"}
    if any(o.split("=", 1)[0] in named for o in options):
        return torchrun_args  # The user's own rendezvous.
    bound_rendezvous.register()
    if _on_loopback_alone(options):
        # One node at a loopback address (`--nnodes 1 --master-port P`):
        # gloo's pairs there too, not where the host name resolves.
        os.environ.update(ports.gloo_on_loopback())
    return bound_rendezvous.static_options(options) + torchrun_args[at:]


def _on_loopback_alone(options):
    """Whether torchrun's `options` start one node at a loopback address."""
    import ipaddress

    nodes = _option_value(options, ("--nnodes",), "1")
    address = _option_value(options, ("--master-addr", "--master_addr"), "127.0.0.1")
    if nodes not in ("1", "1:1"):
        return False
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # A host name: the user's choice of interface.


def _every_rank_preempted(marks, torchrun_args):
    """Whether every rank of this node left its preemption mark."""
    local = _option_value(torchrun_args, ("--nproc-per-node", "--nproc_per_node"), "1")
    try:
        return len(os.listdir(marks)) >= int(local)
    except ValueError:  # "auto", "gpu": the ranks' count is torchrun's.
        return False


def _option_value(args, names, default):
    """The value of the option spelled as one of `names` (`=` or a word)."""
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in names:
            return value if value else (args[i + 1] if i + 1 < len(args) else default)
    return default


def _run_torchrun(run, torchrun_args, SignalException, ChildFailedError):
    """Runs torchrun; returns the launcher's exit code."""
    try:
        with _signals_end_every_rank(SignalException) as received:
            run.run(run.parse_args(torchrun_args))
    except ChildFailedError as error:
        rank, failure = _first_cause(error)
        # A rank that raised left its error file (torch's `record`, in the
        # bootstrap): its traceback is above even if a signal ended it.
        raised = os.path.isfile(failure.error_file)
        print(
            f"keras-parallel launch: rank {rank} "
            f"{supervisor.how_it_ended(failure.exitcode, raised)}.",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as error:
        # A signal torchrun handled itself (SIGHUP, SIGQUIT) is named here;
        # SIGINT and SIGTERM were named when they came.
        signum = received[0] if received else int(error.sigval)
        if not received:
            _stopped_by(signum)
        return 128 + signum
    return 0


def _stopped_by(signum):
    print(
        f"keras-parallel launch: stopped by signal {signum}; ending every rank.",
        file=sys.stderr,
    )


@contextlib.contextmanager
def _signals_end_every_rank(signal_exception):
    """SIGINT (Ctrl-C) or SIGTERM to the launcher ends every rank, quietly.

    torchrun's own handler passed the signal on, so Ctrl-C printed a traceback
    per rank and one of its own. Here each raises torchrun's `SignalException`
    asking for SIGTERM, which its agent sends to every rank; the first signal
    is named in one line and torchrun's warnings about the ranks are silenced.

    Yields:
        The signals received, in order.
    """
    received = []

    def stop(signum, frame):
        if not received:
            _stopped_by(signum)
            logging.disable(logging.WARNING)
        received.append(signum)
        raise signal_exception(
            f"keras-parallel launch got signal {signum}", sigval=signal.SIGTERM
        )

    stopping = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, stop) for s in stopping}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _signals_left_to_launcher(torchrun_args, script):
    """`torchrun_args`, telling torchrun to handle neither SIGINT nor SIGTERM.

    torchrun installs its handlers over the launcher's when it starts the
    ranks (`_signals_end_every_rank`). A list the user gave (the option, or
    `PET_SIGNALS_TO_HANDLE`) is kept. `script` is where torchrun's options end.
    """
    options = torchrun_args[: torchrun_args.index(script)]
    names = {"--signals-to-handle", "--signals_to_handle"}
    if "PET_SIGNALS_TO_HANDLE" in os.environ or any(
        o.split("=", 1)[0] in names for o in options
    ):
        return torchrun_args
    return ["--signals-to-handle", "SIGHUP,SIGQUIT", *torchrun_args]


def _through_bootstrap(torchrun_args, script):
    """Runs the script through `keras_parallel.launcher.bootstrap` (`-m`)."""
    if not _PROGRAM_OPTIONS.isdisjoint(torchrun_args):
        return torchrun_args  # The user's own module or program.
    at = torchrun_args.index(script)
    return (
        torchrun_args[:at]
        + ["-m", "keras_parallel.launcher.bootstrap"]
        + torchrun_args[at:]
    )


def _first_cause(error):
    """The rank that failed first, not one that stopped because of it.

    torchrun orders failures by whole seconds. A rank that raised
    `PeerFailedError` or was ended by a signal (torchrun's SIGTERM to the
    rest) comes after one that exited by itself, and torchrun's SIGTERM after
    another signal (SIGABRT from a gloo error).
    """
    failures = error.failures

    def order(rank):
        failure = failures[rank]
        peer = "PeerFailedError" in str(failure.message)
        stopped = failure.exitcode == -signal.SIGTERM
        return (peer, failure.exitcode < 0, stopped, failure.timestamp, rank)

    rank = min(failures, key=order)
    return rank, failures[rank]


def _backend(argv):
    """`(backend, rest)`: `--backend`, else the one Keras would use, and `argv`
    without the `--backend` option.

    Raises:
        ValueError: a backend the launcher cannot start, naming its source.
    """
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
    source = "--backend"
    if not backend:
        # Read, not imported: importing Keras would start a backend in the
        # launcher, and JAX's runtime must start in its processes.
        backend, source = keras_config.configured_backend()
    if backend not in BACKENDS:
        raise ValueError(
            "keras-parallel launch starts processes for the jax, tensorflow "
            f"and torch backends. Received: backend {backend!r} (from "
            f"{source}); pass --backend jax, --backend tensorflow or "
            "--backend torch, or set KERAS_BACKEND."
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
    # torchrun's options only: the script's own arguments are not ours.
    end = torchrun_args.index(script) if script in torchrun_args else None
    for i, arg in enumerate(torchrun_args[:end]):
        name, _, value = arg.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            value = value or (
                torchrun_args[i + 1] if i + 1 < len(torchrun_args) else ""
            )
            if value in _DEVICE_COUNTS:
                continue
            try:
                count = int(value)
            except ValueError:
                raise ValueError(
                    "--nproc must be a positive number of processes. Received: "
                    f"--nproc {value}; pass e.g. --nproc 2 (or torchrun's "
                    f"{', '.join(_DEVICE_COUNTS)})."
                ) from None
            check_positive("--nproc", count)
    is_path = _PROGRAM_OPTIONS.isdisjoint(torchrun_args)
    check_script(script, torchrun_args, is_path=is_path)


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
    flags = {"--standalone", "--run-path", "--run_path", *_PROGRAM_OPTIONS}
    return option.startswith("-") and "=" not in option and option not in flags
