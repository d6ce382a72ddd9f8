"""ModelParallel on a (1, 4) mesh against DataParallel (DDP), on torch.

An MLP of about 100 M parameters (2048 -> 8192 -> 8192 -> 2048, float32:
402 MB of weights) trains with `model.fit` in 4 gloo processes, once under
`keras_parallel.DataParallel()` (DDP: every process holds the whole model,
its gradients and DDP's buckets) and once under `ModelParallel` on a mesh
`(data=1, model=4)` with every kernel split 4 ways (d1 and d3 by columns, d2
by rows, as Megatron does): each process holds a quarter.

For each, rank 0 prints the seconds per step (median of `--steps` timed
steps after one warm-up step) and the memory per process: the peak resident
set during the timed steps (`VmHWM`, reset after the warm-up), less the
process's resident set before the model was built, after a tiny model was
trained under the same kind of distribution (torch, Keras, the TensorFlow
its data adapters import, the process group: what every process holds
whatever the model). Target: ModelParallel's at most 0.30 of DDP's. No speed target on
CPU: the split model all-reduces activations in every layer over gloo.

Usage:

    KERAS_BACKEND=torch python benchmarks/bench_torch_model_parallel.py \\
        [--steps 5] [--batch 32]
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

from process_memory import status_kib, timed_steps  # noqa: E402

from keras_parallel.keras_seam.model_state import binding_of

WIDTHS = (2048, 8192, 8192, 2048)
KINDS = ("ddp", "model_parallel")


def _build(distributed, kind):
    import keras

    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    inputs = keras.Input((WIDTHS[0],))
    x = keras.layers.Dense(WIDTHS[1], activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(WIDTHS[2], activation="relu", name="d2")(x)
    outputs = keras.layers.Dense(WIDTHS[3], name="d3")(x)
    model = Net(inputs=inputs, outputs=outputs, name="mlp100m")
    layouts = {
        "d1/kernel": (None, "model"),
        "d1/bias": ("model",),
        "d2/kernel": ("model", None),
        "d3/kernel": (None, "model"),
        "d3/bias": ("model",),
    }
    model.compile(
        optimizer=keras.optimizers.SGD(1e-3),
        loss="mse",
        distribution=_distribution(kind, layouts),
    )
    return model


def _distribution(kind, layouts):
    """DataParallel for `"ddp"`, else ModelParallel on `(1, 4)` by `layouts`."""
    import keras

    import keras_parallel

    if kind == "ddp":
        return keras_parallel.DataParallel()
    devices = keras_parallel.DataParallel().device_mesh.devices.ravel().tolist()
    mesh = keras.distribution.DeviceMesh((1, 4), ["data", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in layouts.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"
    )


def _tiny_fit(kind, x, y):
    import gc

    import keras

    import keras_parallel

    class Tiny(keras_parallel.DistributedModel, keras.Model):
        pass

    inputs = keras.Input((WIDTHS[0],))
    outputs = keras.layers.Dense(WIDTHS[-1], name="d3")(inputs)
    model = Tiny(inputs=inputs, outputs=outputs)
    distribution = _distribution(kind, {"d3/kernel": (None, "model")})
    model.compile(optimizer="sgd", loss="mse", distribution=distribution)
    model.fit(x[:32], y[:32], batch_size=32, verbose=0)
    del model
    gc.collect()


def worker(kind, steps, batch):
    import keras
    import numpy as np

    # Before the baseline: Keras's `set_random_seed` imports TensorFlow
    # (about 400 MiB) where it is installed.
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * (steps + 1), WIDTHS[0])).astype("float32")
    y = rng.normal(size=(batch * (steps + 1), WIDTHS[-1])).astype("float32")
    # What every process holds whatever the model: torch, Keras, the
    # TensorFlow that Keras's data adapters import, the process group and
    # DDP's or DTensor's own state, all made by a tiny model trained first.
    _tiny_fit(kind, x, y)
    before = status_kib("VmRSS")
    model = _build(True, kind)
    times = timed_steps(model, x, y, batch, steps)
    peak = status_kib("VmHWM")
    plan = binding_of(model).plan
    return {
        "step_s": statistics.median(times),
        "model_mib": (peak - before) / 1024,
        "peak_mib": peak / 1024,
        "plan_mib": plan.bytes_per_device() / 2**20,
        "params": sum(int(np.prod(v.shape)) for v in model.trainable_variables),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    from keras_parallel.launcher.torch_processes import launch

    results = {}
    for kind in KINDS:
        ranks = launch(worker, 4, args=(kind, args.steps, args.batch), timeout=1800)
        results[kind] = ranks
        worst = max(r["model_mib"] for r in ranks)
        print(
            f"{kind:15s} params {ranks[0]['params'] / 1e6:.1f} M  "
            f"step {ranks[0]['step_s']:.2f} s  "
            f"memory per process {worst:.0f} MiB "
            f"(peak RSS {max(r['peak_mib'] for r in ranks):.0f} MiB; "
            f"plan: {ranks[0]['plan_mib']:.0f} MiB of variables)"
        )
    ratio = max(r["model_mib"] for r in results["model_parallel"]) / max(
        r["model_mib"] for r in results["ddp"]
    )
    speed = results["model_parallel"][0]["step_s"] / results["ddp"][0]["step_s"]
    print(f"memory ModelParallel / DDP: {ratio:.2f} (target <= 0.30)")
    print(f"time per step ModelParallel / DDP: {speed:.2f}")
    return 0 if ratio <= 0.30 else 1


if __name__ == "__main__":
    sys.exit(main())
