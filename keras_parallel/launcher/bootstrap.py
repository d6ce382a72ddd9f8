"""What `keras-parallel launch` runs in each process, before the user's script.

It starts the runtime (`jax.distributed`, or TensorFlow's strategy), then the
script as `__main__`. A failing process exits at once: the others may wait for
it in a collective or at JAX's exit barrier.
"""

import os
import runpy
import sys
import traceback

from keras_parallel.launcher import parent_death
from keras_parallel.launcher.supervisor import BROKEN_COLLECTIVE_EXIT_CODE
from keras_parallel.persistence.preemption_settings import PREEMPTED_EXIT_CODE


def main(argv=None):
    """Starts the runtime, then runs `argv[0]` with `argv` as `sys.argv`."""
    # First: a launcher killed outright must not leave this process running.
    parent_death.end_with_launcher()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m keras_parallel.launcher.bootstrap script.py")
    backend = os.environ.get("KERAS_BACKEND")
    if backend == "torch":
        return _run_torch(argv)
    process, initialize = _runtime(backend)
    try:
        initialize()
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
    except BaseException as error:
        print(f"keras-parallel: {process} failed:", file=sys.stderr)
        traceback.print_exc()
        _exit(BROKEN_COLLECTIVE_EXIT_CODE if _broken_collective(error) else 1)


def _runtime(backend):
    """This process's name and the function that starts its runtime."""
    if backend == "tensorflow":
        # TensorFlow's C++ INFO lines at server start repeat the launcher's;
        # warnings (lost heartbeats) still print. Read when TensorFlow loads,
        # so set before the import; a level the user set is kept.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        from keras_parallel.backends.tensorflow import workers

        workers.fill_tf_config()  # Under srun or mpirun, for the name too.
        name = f"worker {workers.cluster_workers()[1]}"
        return name, workers.initialize_from_environment
    from keras_parallel.backends.jax import runtime

    name = f"process {os.environ.get(runtime.ID_ENV, '0')}"
    return name, runtime.initialize_from_environment


def _run_torch(argv):
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def run():
        sys.argv = argv
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit_:
            if exit_.code == PREEMPTED_EXIT_CODE:
                _mark_preempted()
            raise

    run()


#: Folder where each rank a preemption stopped leaves a file (torch): torchrun,
#: stopped by the same signal, does not report the ranks' exit codes.
PREEMPTED_MARKS_ENV = "KERAS_PARALLEL_PREEMPTED_MARKS"


def _mark_preempted():
    marks = os.environ.get(PREEMPTED_MARKS_ENV)
    if marks and os.path.isdir(marks):
        rank = os.environ.get("RANK", str(os.getpid()))
        with open(os.path.join(marks, f"rank{rank}"), "w"):
            pass


def _broken_collective(error):
    """Whether a JAX process failed only because a peer broke a collective;
    the launcher names it only if no process names a cause of its own."""
    if type(error).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
        return False
    text = str(error).lower()
    return any(
        word in text
        for word in ("gloo", "nccl", "connection reset", "connection closed")
    )


def _exit(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
