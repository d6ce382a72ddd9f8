"""What the run's control plane costs: store requests, start-up, host time.

Every process of a run talks to one coordinator's key-value store: the
preemption's stop agreement looks for a notice there, and the stall watch
publishes the process's position there (keras_parallel/run/heartbeat.py: one
thread, one tick a second). This measures, for N torch processes (gloo on
this machine's CPU, `keras_parallel.launch` with the forkserver start
method) training one small model with `fit`:

- store requests a second per process while `fit` steps (every `set` and
  `try_get` of the run's store, counted in each process from its first
  step to its last);
- seconds from the launch to the first step of process 0;
- milliseconds of host time per step (`fit`'s wall time over its steps),
  with the stall watch on (its default timeout) and off
  (`KERAS_PARALLEL_STALL_TIMEOUT=0`): the same within noise.

Dense 16 -> 32 -> 8, SGD, a global batch of 2 rows per process, `--steps`
steps of one epoch; the watch on and off alternate, `--rounds` times; the
medians are printed as a Markdown table.

Usage:

    python benchmarks/control_plane.py [--processes 2 8 32] [--steps 1000]
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
#: This checkout's keras_parallel, here and in every process launched (an
#: env's installed copy may be older).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
)


def _worker(steps, watch, launched_at):
    os.environ["KERAS_PARALLEL_STALL_TIMEOUT"] = "" if watch else "0"
    import keras
    import numpy as np

    import keras_parallel
    from keras_parallel.backends.torch.executor import TorchExecutor

    counts = {"requests": 0}
    own_store = TorchExecutor.key_value_store

    class CountedStore:
        def __init__(self, store):
            self.store = store

        def set(self, key, value):
            counts["requests"] += 1
            return self.store.set(key, value)

        def try_get(self, key):
            counts["requests"] += 1
            return self.store.try_get(key)

        def __getattr__(self, name):
            return getattr(self.store, name)

    TorchExecutor.key_value_store = lambda self: CountedStore(own_store(self))
    world = int(os.environ["WORLD_SIZE"])

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = Net(inputs, keras.layers.Dense(8)(hidden))
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    batch = 2 * world
    x = np.zeros((batch * steps, 16), "float32")
    y = np.zeros((batch * steps, 8), "float32")
    first = {}

    class Steps(keras.callbacks.Callback):
        # The requests of the steps alone, from the first to the last: the
        # run's start (the join, the plan's agreement) is counted in
        # "first step, s", not in the steady rate.
        def on_train_batch_begin(self, batch, logs=None):
            if not first:
                first.update(at=time.time(), tick=time.monotonic())
                first["requests"] = counts["requests"]

        def on_train_end(self, logs=None):
            first["end"] = time.monotonic()
            first["end_requests"] = counts["requests"]

    began = time.monotonic()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[Steps()])
    seconds = time.monotonic() - began
    stepping = first["end"] - first["tick"]
    return {
        "requests_per_s": (first["end_requests"] - first["requests"]) / stepping,
        "first_step_s": first["at"] - launched_at,
        "host_ms": 1000 * seconds / steps,
    }


def measure(processes, steps, watch):
    """One launch; process 0's first step, the mean of the others."""
    from keras_parallel.launcher.torch_processes import launch

    results = launch(
        _worker,
        processes,
        args=(steps, watch, time.time()),
        timeout=900,
        threads_per_process=1,
        start_method="forkserver",
    )
    return {
        "requests_per_s": statistics.mean(r["requests_per_s"] for r in results),
        "first_step_s": results[0]["first_step_s"],
        "host_ms": statistics.mean(r["host_ms"] for r in results),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(
        "| processes | store requests/s per process (watch on) | first step, s "
        "| host ms/step, watch on | host ms/step, watch off | on / off |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for processes in args.processes:
        runs = {True: [], False: []}
        for _ in range(args.rounds):
            for watch in (True, False):
                runs[watch].append(measure(processes, args.steps, watch))

        def median(watch, key):
            return statistics.median(r[key] for r in runs[watch])

        on, off = median(True, "host_ms"), median(False, "host_ms")
        print(
            f"| {processes} | {median(True, 'requests_per_s'):.2f} "
            f"| {median(True, 'first_step_s'):.1f} | {on:.2f} | {off:.2f} "
            f"| {on / off:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
