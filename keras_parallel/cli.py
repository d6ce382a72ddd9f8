"""The `keras-parallel` command line.

`keras-parallel demo [--backend B]` trains the Keras guide's convnet on the
digits data across all local devices (8 simulated CPU devices when there is
no accelerator; on torch, that many gloo processes) and prints the layout
table and the accuracy.

`keras-parallel launch [--backend B] --nproc N train.py [args]` runs a
training script in N processes of this node (more options: several nodes,
restarts): JAX through `jax.distributed`, torch through
`torch.distributed.run` (torchrun), TensorFlow through
`MultiWorkerMirroredStrategy`. `keras-parallel launch --help` lists the
options.

`keras-parallel env` prints the versions and devices to put in a bug report;
`keras-parallel --version` the version alone.
"""

import argparse
import functools
import os
import sys

BACKENDS = ("jax", "torch", "tensorflow")
SIMULATED_DEVICES = 8


def _demo(args):
    os.environ["KERAS_BACKEND"] = args.backend
    # The demo is ours to keep quiet: TensorFlow's C++ start-up lines (when
    # it is installed, whatever the backend) say nothing about the demo.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.backend == "tensorflow":
        # oneDNN's Conv2D mis-shapes the empty per-device batch that a last
        # batch smaller than the device count leaves (449 % 32 = 1 here);
        # TensorFlow reads this only when it is imported.
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if args.backend == "jax":
        # Simulated CPU devices; with a GPU or TPU, JAX uses those instead.
        # An explicit --devices wins over a device count already in XLA_FLAGS.
        flags = os.environ.get("XLA_FLAGS", "")
        if args.devices is not None or "device_count" not in flags:
            kept = [f for f in flags.split() if "device_count" not in f]
            count = args.devices or SIMULATED_DEVICES
            kept.append(f"--xla_force_host_platform_device_count={count}")
            os.environ["XLA_FLAGS"] = " ".join(kept)
    from keras_parallel import demo
    from keras_parallel.launcher.demo_processes import demo_processes

    # A partial of a module-level function: picklable, so a backend may run
    # it in processes it starts (torch: one per device).
    run = functools.partial(demo.run, epochs=args.epochs, batch_size=args.batch_size)
    devices = args.devices or SIMULATED_DEVICES
    processes = demo_processes(args.backend, devices)
    if processes == 1:
        accuracy = run()
    else:
        from keras_parallel.launcher import launch

        accuracy = launch(run, num_processes=processes)[0]
    print(f"Test accuracy: {accuracy:.4f}")
    return 0


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer. Received: {text!r}; pass e.g. 2"
        )
    return value


def _env(args):
    from keras_parallel import bug_report

    print(bug_report.report())
    return 0


def main(argv=None):
    """Entry point of the `keras-parallel` command.

    Args:
        argv: the arguments, without the program name. Defaults to
            `sys.argv[1:]`.

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        # Everything after `launch` is the launcher's (on torch, torchrun's):
        # argparse must not touch it.
        from keras_parallel.launcher import command as launch_command

        return launch_command.main(argv[1:])
    from keras_parallel import __version__

    parser = argparse.ArgumentParser(
        prog="keras-parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"keras-parallel {__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train the Keras guide's convnet on digits, on every device"
    )
    demo.add_argument(
        "--backend",
        choices=BACKENDS,
        default=os.environ.get("KERAS_BACKEND", "jax"),
        help="the Keras backend (default: $KERAS_BACKEND, else jax)",
    )
    demo.add_argument("--epochs", type=_positive_int, default=30)
    demo.add_argument(
        "--batch-size", type=_positive_int, default=32, help="the global batch"
    )
    demo.add_argument(
        "--devices",
        type=_positive_int,
        default=None,
        help="simulated CPU devices (or processes) when there is no accelerator "
        f"(default {SIMULATED_DEVICES})",
    )
    demo.set_defaults(func=_demo)
    commands.add_parser(
        "launch",
        help="run a script in N processes on any backend: keras-parallel launch "
        "[--backend B] --nproc N train.py [args] (torch: torchrun's options "
        "pass through)",
        add_help=False,
    )
    commands.add_parser(
        "env", help="print the versions and devices to put in a bug report"
    ).set_defaults(func=_env)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
