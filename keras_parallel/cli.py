"""The `keras-parallel` command line.

`keras-parallel demo [--backend B]` trains the Keras guide's convnet on the
digits data across all local devices (8 simulated CPU devices when there is
no accelerator) and prints the layout table and the accuracy.
"""

import argparse
import os
import sys

BACKENDS = ("jax", "torch", "tensorflow")
SIMULATED_DEVICES = 8


def _demo(args):
    os.environ["KERAS_BACKEND"] = args.backend
    if args.backend == "jax" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Simulated CPU devices; with a GPU or TPU, JAX uses those instead.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    from keras_parallel import demo
    from keras_parallel.executors import executor_class

    def run():
        accuracy = demo.run(epochs=args.epochs, batch_size=args.batch_size)
        return accuracy

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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
