"""`python cluster_join_probe.py MODE`: what importing Keras does to JAX.

One process, with the variables the test gives it (a fake launcher's, or
none); prints one JSON line. `jax.distributed.initialize` is replaced by a
recorder before Keras is imported, except in the `real` and
`devices_first` modes, so that a process that should not join but does is
seen at once rather than after JAX's 300 s wait for the others:

- `record`: imports keras_parallel, then Keras; reports the recorded calls,
  `KERAS_PARALLEL_JOINED_PID` and whether `sys.excepthook` was replaced.
- `real`: the same with JAX's own `initialize`; reports whether it started.
- `spawn`: a `multiprocessing` child (spawn) does `record`'s import and
  reports; the parent imports no Keras (it joined nothing).
- `devices_first`: asks JAX for its devices before importing Keras, which
  JAX's `initialize` refuses; reports the error of `import keras`, and of a
  second `import keras`.
"""

import json
import multiprocessing
import os
import sys

import jax

calls = []


def record_initialize(*args, **kwargs):
    calls.append({k: v for k, v in kwargs.items() if v is not None})


def report(**values):
    line = json.dumps(values)
    os.write(1, (line + "\n").encode())  # One write: a child shares the pipe.


def import_and_report():
    import keras

    import keras_parallel  # noqa: F401  (after Keras: the hook runs at once)

    report(
        calls=calls,
        initialized=jax.distributed.is_initialized(),
        joined_pid=os.environ.get("KERAS_PARALLEL_JOINED_PID"),
        pid=os.getpid(),
        excepthook_replaced=sys.excepthook is not sys.__excepthook__,
        backend=keras.backend.backend(),
    )


def import_keras_twice():
    import keras_parallel  # noqa: F401  (first: the hook waits for Keras)

    errors = []
    for _ in range(2):
        try:
            import keras  # noqa: F401
        except Exception as error:
            cause = error.__cause__
            errors.append(
                {
                    "type": type(error).__name__,
                    "message": str(error),
                    "cause": None if cause is None else type(cause).__name__,
                    "cause_message": None if cause is None else str(cause),
                }
            )
        else:
            errors.append(None)
    report(errors=errors, initialized=jax.distributed.is_initialized())


if __name__ == "__main__" or os.environ.get("PROBE_RECORD") == "1":
    # Also in a spawned child, which imports this file as `__mp_main__`.
    mode = sys.argv[1] if __name__ == "__main__" else "spawn"
    if mode in ("record", "spawn"):
        os.environ["PROBE_RECORD"] = "1"
        jax.distributed.initialize = record_initialize

if __name__ == "__main__":
    if mode in ("record", "real"):
        import_and_report()
    elif mode == "spawn":
        child = multiprocessing.get_context("spawn").Process(target=import_and_report)
        child.start()
        child.join()
        sys.exit(child.exitcode)
    elif mode == "devices_first":
        jax.devices()  # The backend starts: JAX's `initialize` refuses now.
        import_keras_twice()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
