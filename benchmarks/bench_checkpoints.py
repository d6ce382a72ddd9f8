"""Orbax checkpoints of a ModelParallel model: save, overlap, restore, memory.

A 54.6 M-parameter MLP (1024 -> 3 x 4096 -> 16, Adam: 655 MB of state) on a
`(1, 8)` mesh, every kernel and bias split over `model`, trains with Keras's
own `keras.callbacks.OrbaxCheckpoint(save_freq=N)`, one save per `fit`,
asynchronous (Keras's default) and synchronous (`save_on_background=False`)
runs interleaved A B B A each round. Measured within each run, against the
steps before its save (this shared 2-core machine drifts too much between
runs for differences of whole runs to mean anything):

- a synchronous save's wall time: the time its hook holds the loop;
- an asynchronous save's cost to the loop: the time its hook holds the
  loop (the copy of every array off the devices), then the extra time of
  the steps that ran while it wrote in the background (on a CPU, the
  writer and the step share the cores). Target: under 0.10 of a
  synchronous save's wall time.
- Restore time of `keras_parallel.restore_checkpoint` into a fresh model
  on the same mesh and on a `(2, 4)` mesh, and of Keras's own
  `model.load_weights(directory)` on the same mesh.
- Memory during restore, in a fresh process each: the growth of host RSS
  (which holds the CPU devices' buffers too) and the most bytes any one
  device holds, against the size of the state. The model is created under
  `distribution.scope()`, so no device ever holds all of it.

Run: `python benchmarks/bench_checkpoints.py [--rounds 2] [--steps 47] [--save-freq 24]`.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_parallel  # noqa: E402
from keras_parallel.keras_seam.model_state import binding_of

WIDTH, INPUTS, OUTPUTS, DEPTH, BATCH = 4096, 1024, 16, 3, 32


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def distribution(shape):
    mesh = keras.distribution.DeviceMesh(shape, ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d[0-9]+/kernel"] = (None, "model")
    layout_map["d[0-9]+/bias"] = ("model",)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def build(shape=(1, 8)):
    """The MLP, compiled on `shape`, created sharded (never whole on a device)."""
    # Fresh names ("adam", not "adam_1"): Keras's load_weights matches them.
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    dist = distribution(shape)
    with dist.scope():
        inputs = keras.Input((INPUTS,))
        x = inputs
        for i in range(DEPTH + 1):
            x = keras.layers.Dense(WIDTH, activation="relu", name=f"d{i}")(x)
        outputs = keras.layers.Dense(OUTPUTS, name="head")(x)
        model = Net(inputs=inputs, outputs=outputs, name="net")
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", distribution=dist)
    return model


def state_bytes(model):
    variables = list(model.variables) + list(model.optimizer.variables)
    return sum(int(np.prod(v.shape)) * v.value.dtype.itemsize for v in variables)


class TimedOrbaxCheckpoint(keras.callbacks.OrbaxCheckpoint):
    """Keras's callback, noting when each step ended, how long its hook
    blocked the loop, and at which step its background save had finished."""

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.ends, self.hooks, self.finished, self.saving = [], [], None, False

    def on_train_batch_end(self, batch, logs=None):
        start = time.perf_counter()
        if self.saving and not self.checkpointer.is_saving_in_progress():
            self.saving, self.finished = False, batch
        super().on_train_batch_end(batch, logs)
        self.ends.append(start)
        self.hooks.append(time.perf_counter() - start)
        if self.finished is None and self.checkpointer.is_saving_in_progress():
            self.saving = True

    def costs(self):
        """`(s blocked, s of extra step time while saving, whether the save
        finished before the loop's end, s per step before the save)`.

        Each step's time excludes the hook before it; the steps before the
        save are the baseline the steps during it are compared with.
        """
        steps = [
            self.ends[i] - self.ends[i - 1] - self.hooks[i - 1]
            for i in range(1, len(self.ends))
        ]  # steps[i - 1] ends at batch i
        save = int(np.argmax(self.hooks))
        baseline = statistics.median(steps[1 : save - 1])
        last = len(self.ends) - 1 if self.finished is None else self.finished
        extra = sum(steps[i - 1] - baseline for i in range(save + 1, last + 1))
        return self.hooks[save], extra, self.finished is not None, baseline

    def on_train_end(self, logs=None):
        start = time.perf_counter()
        super().on_train_end(logs)  # waits for the background save
        self.tail = time.perf_counter() - start


def speed(rounds, steps, save_freq, root):
    model = build()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, INPUTS)).astype("float32")
    y = rng.normal(size=(steps * BATCH, OUTPUTS)).astype("float32")
    # One save, with steps before it (the baseline) and after it (to
    # overlap): this shared 2-core machine drifts too much between runs
    # for differences of whole runs to mean anything.
    if not save_freq <= steps < 2 * save_freq:
        raise ValueError(
            "Need save_freq <= steps < 2 * save_freq. Received: "
            f"steps={steps}, save_freq={save_freq}."
        )
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)  # compile
    results = {"async": [], "sync": []}
    tails = []
    for _ in range(rounds):
        for kind in ("async", "sync", "sync", "async"):
            shutil.rmtree(root, ignore_errors=True)
            checkpoint = TimedOrbaxCheckpoint(
                root, save_freq=save_freq, save_on_background=kind == "async"
            )
            model.fit(
                x,
                y,
                batch_size=BATCH,
                shuffle=False,
                verbose=0,
                callbacks=[checkpoint],
            )
            results[kind].append(checkpoint.costs())
            if kind == "async":
                tails.append(checkpoint.tail)
    sync_wall = statistics.median(r[0] for r in results["sync"])
    blocked = statistics.median(r[0] for r in results["async"])
    extra = statistics.median(r[1] for r in results["async"])
    finished = sum(r[2] for r in results["async"])
    step = statistics.median(r[3] for r in results["async"] + results["sync"])
    tail = statistics.median(tails)
    print(
        f"{state_bytes(model) / 1e6:.0f} MB of state ({model.count_params() / 1e6:.1f} M "
        f"parameters), (1, 8) mesh, batch {BATCH}, one save at step {save_freq} "
        f"of {steps}, {rounds} rounds (medians):\n"
        f"  step {step:.3f} s before the save\n"
        f"  synchronous save: {sync_wall:.3f} s (its wall time, all of it in the loop)\n"
        f"  asynchronous save: {blocked:.3f} s blocked in the callback's hook, then "
        f"{extra:.3f} s slower steps while it wrote in the background "
        f"(finished before the loop's end in {finished} of {len(results['async'])} "
        f"runs; else a lower bound); fit's end then waited {tail:.3f} s for it\n"
        f"  async blocked / sync wall = {blocked / sync_wall:.3f} (target < 0.10); "
        f"(blocked + slower steps) / sync wall = {(blocked + extra) / sync_wall:.3f}"
    )


def restore_times(root, repeats=3):
    def ours(shape):
        model = build(shape)
        model.optimizer.build(model.trainable_variables)  # as for Keras's, below
        binding_of(model).apply(model)
        start = time.perf_counter()
        keras_parallel.restore_checkpoint(model, root)
        return time.perf_counter() - start

    def keras_own():
        model = build((1, 8))
        model.optimizer.build(model.trainable_variables)
        binding_of(model).apply(model)
        start = time.perf_counter()
        model.load_weights(root)
        return time.perf_counter() - start

    runs = {
        "restore_checkpoint, same (1, 8) mesh": lambda: ours((1, 8)),
        "restore_checkpoint, other (2, 4) mesh": lambda: ours((2, 4)),
        "Keras load_weights, same (1, 8) mesh": keras_own,
    }
    seconds = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            seconds[name].append(run())
    for name, values in seconds.items():
        print(f"  restore: {name}: {', '.join(f'{v:.2f}' for v in values)} s")


def device_bytes():
    """`(most bytes on one device, bytes on all)` of the live arrays."""
    # Orbax assembles each array from per-device arrays that share its
    # buffers: count every buffer once.
    buffers = {}
    for array in jax.live_arrays():
        try:
            for shard in array.addressable_shards:
                data = shard.data
                buffers[(shard.device, data.unsafe_buffer_pointer())] = data.nbytes
        except Exception:  # deleted while we looked: a sample, not a check
            continue
    per_device = {}
    for (device, _), nbytes in buffers.items():
        per_device[device] = per_device.get(device, 0) + nbytes
    return max(per_device.values(), default=0), sum(per_device.values())


def measure_restore(root, how):
    """In a fresh process: memory while restoring (prints JSON)."""
    import psutil

    model = build()
    model.optimizer.build(model.trainable_variables)
    binding_of(model).apply(model)
    process = psutil.Process()
    before = {"rss": process.memory_info().rss, "device": device_bytes()}
    peak = {"rss": before["rss"], "device": before["device"]}
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["rss"] = max(peak["rss"], process.memory_info().rss)
            peak["device"] = tuple(map(max, peak["device"], device_bytes()))
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    start = time.perf_counter()
    if how == "keras_parallel":
        keras_parallel.restore_checkpoint(model, root)
    elif how == "keras_parallel_64MB":
        import orbax.checkpoint as orbax

        # Orbax 0.12.8 deprecates Context(memory_options=...): set the
        # limit on the context before entering it.
        context = orbax.v1.Context()
        context.memory.read_concurrent_bytes = 64 << 20
        with context:
            keras_parallel.restore_checkpoint(model, root)
    else:
        model.load_weights(root)
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    print(
        json.dumps(
            {
                "state": state_bytes(model),
                "seconds": seconds,
                "rss_growth": peak["rss"] - before["rss"],
                "device_before": before["device"][0],
                "device_peak": peak["device"][0],
                "devices_total_peak": peak["device"][1],
            }
        )
    )


def restore_memory(root):
    for how in ("keras_parallel", "keras_parallel_64MB", "keras"):
        out = subprocess.run(
            [sys.executable, __file__, "--measure-restore", root, how],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            print(f"  memory restoring with {how}: failed:\n{out.stderr[-2000:]}")
            continue
        m = json.loads(out.stdout.strip().splitlines()[-1])
        state = m["state"]
        print(
            f"  memory restoring with {how} ({m['seconds']:.2f} s): host RSS grew "
            f"{m['rss_growth'] / 1e6:.0f} MB ({m['rss_growth'] / state:.2f} x the "
            f"{state / 1e6:.0f} MB state); the fullest device held "
            f"{m['device_before'] / 1e6:.0f} MB before, at most "
            f"{m['device_peak'] / 1e6:.0f} MB during ({m['device_peak'] / state:.3f} "
            f"x the state); all devices at most {m['devices_total_peak'] / 1e6:.0f} MB "
            f"({m['devices_total_peak'] / state:.2f} x: old and new values)"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=47)
    parser.add_argument("--save-freq", type=int, default=24)
    parser.add_argument("--measure-restore", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_restore:
        measure_restore(*args.measure_restore)
        return
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"jax {jax.__version__}, keras {keras.__version__}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ckpt")
        speed(args.rounds, args.steps, args.save_freq, root)
        restore_times(root)
        restore_memory(root)


if __name__ == "__main__":
    main()
