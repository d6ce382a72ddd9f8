"""The `keras-parallel` command line.

`keras-parallel demo [--backend B]` trains the Keras guide's convnet on the
digits data across all local devices (8 simulated CPU devices when there is
no accelerator; on torch, that many gloo processes) and prints the layout
table and the accuracy.

`keras-parallel launch --nproc N train.py [args]` runs a training script in
N processes through `torch.distributed.run` (torchrun).
"""

import argparse
import functools
import os
import sys

BACKENDS = ("jax", "torch", "tensorflow")
SIMULATED_DEVICES = 8


def _demo(args):
    os.environ["KERAS_BACKEND"] = args.backend
    if args.backend == "tensorflow":
        # oneDNN's Conv2D mis-shapes the empty per-device batch that a last
        # batch smaller than the device count leaves (449 % 32 = 1 here);
        # TensorFlow reads this only when it is imported.
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if args.backend == "jax" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Simulated CPU devices; with a GPU or TPU, JAX uses those instead.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    from keras_parallel import demo
    from keras_parallel.backends import executor_class

    # A partial of a module-level function: picklable, so a backend may run
    # it in processes it starts (torch: one per device).
    run = functools.partial(demo.run, epochs=args.epochs, batch_size=args.batch_size)
    accuracy = executor_class(args.backend).demo_main(run, args.devices)
    print(f"Test accuracy: {accuracy:.4f}")
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
        # Everything after `launch` is torchrun's: argparse must not touch it.
        from keras_parallel.launcher import cli as launch_cli

        return launch_cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="keras-parallel", description=__doc__)
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
    demo.add_argument("--epochs", type=int, default=30)
    demo.add_argument("--batch-size", type=int, default=32, help="the global batch")
    demo.add_argument(
        "--devices",
        type=int,
        default=SIMULATED_DEVICES,
        help="simulated CPU devices (or processes) when there is no accelerator",
    )
    demo.set_defaults(func=_demo)
    commands.add_parser(
        "launch",
        help="run a script in N processes: keras-parallel launch --nproc N "
        "train.py [args] (torchrun options pass through)",
        add_help=False,
    )
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
