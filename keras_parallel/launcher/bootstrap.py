"""`python -m keras_parallel.launcher.bootstrap script.py [args]`.

What `keras-parallel launch` runs in each process it starts, before the
user's unchanged script (run as `__main__`):

- JAX: start the multi-process runtime from the environment
  (`jax.distributed`, through `keras.distribution.initialize()`). A process
  whose script raises prints the traceback under its process number and
  exits at once: the runtime's exit would wait for the other processes at a
  barrier they may never reach.
- torch (under torchrun): run the script under torch's `record`, which
  leaves the exception in torchrun's error file, so that the launcher can
  tell the rank that failed first from the ranks that stopped because of it.
"""

import os
import runpy
import sys
import traceback


def main(argv=None):
    """Starts the runtime, then runs `argv[0]` with `argv` as `sys.argv`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m keras_parallel.launcher.bootstrap script.py")
    if os.environ.get("KERAS_BACKEND") == "torch":
        return _run_torch(argv)
    from keras_parallel.backends.jax import runtime

    process = os.environ.get(runtime.ID_ENV, "0")
    try:
        runtime.initialize_from_environment()
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = (
            exit_.code
            if isinstance(exit_.code, int)
            else (0 if exit_.code is None else 1)
        )
        if code:
            _exit(code)
        raise
    except BaseException:
        print(f"keras-parallel: process {process} failed:", file=sys.stderr)
        traceback.print_exc()
        _exit(1)


def _run_torch(argv):
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def run():
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")

    run()


def _exit(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
