"""torch `shard=` against DataParallel (DDP): memory per process, step time.

An MLP of about 100 M parameters (2048 -> 8192 -> 8192 -> 2048, float32:
402 MB of weights) trains with Adam in `model.fit` in 4 gloo processes,
under `keras_parallel.DataParallel()` (DDP: every process holds the whole
model, its gradients, Adam's two slots and DDP's buckets), under
`DataParallel(shard="full")` and under `DataParallel(shard="optimizer")`.

For each, rank 0 prints the seconds per step (median of `--steps` timed
steps after one warm-up step) and the memory per process: the peak
resident set during the timed steps (`VmHWM`, reset after the warm-up),
less the resident set before the model was built, after a tiny model was
trained under the same distribution (torch, Keras, the process group:
what every process holds whatever the model). Target: `"full"` at most
0.35 of DDP's.

Then the demonstration: each process's address space is capped
(`RLIMIT_AS`, `--cap-mib` above what it has mapped before building the
model) and both train again: DDP fails (out of memory), `"full"` trains.

Usage:

    KERAS_BACKEND=torch python benchmarks/bench_torch_sharding.py \\
        [--steps 3] [--batch 32] [--cap-mib 1600]
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

from process_memory import status_kib, timed_steps  # noqa: E402

from keras_parallel.keras_seam.model_state import binding_of

WIDTHS = (2048, 8192, 8192, 2048)
KINDS = ("ddp", "full", "optimizer")


def _distribution(kind):
    import keras_parallel

    return keras_parallel.DataParallel(shard=None if kind == "ddp" else kind)


def _model(kind, widths):
    import keras

    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    distribution = _distribution(kind)
    with distribution.scope():  # "full": made in its shards.
        inputs = keras.Input((widths[0],))
        x = inputs
        for index, width in enumerate(widths[1:-1]):
            x = keras.layers.Dense(width, activation="relu", name=f"d{index}")(x)
        outputs = keras.layers.Dense(widths[-1], name="out")(x)
        model = Net(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4), loss="mse", distribution=distribution
    )
    return model


def worker(kind, steps, batch, cap_mib):
    import gc
    import resource

    import keras
    import numpy as np

    # Before the baseline: Keras's `set_random_seed` imports TensorFlow
    # (about 400 MiB) where it is installed.
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * (steps + 1), WIDTHS[0])).astype("float32")
    y = rng.normal(size=(batch * (steps + 1), WIDTHS[-1])).astype("float32")
    tiny = _model(kind, (WIDTHS[0], 64, WIDTHS[-1]))
    tiny.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
    del tiny
    gc.collect()
    before = status_kib("VmRSS")
    if cap_mib:
        limit = (status_kib("VmSize") + cap_mib * 1024) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        model = _model(kind, WIDTHS)
        times = timed_steps(model, x, y, batch, steps)
    except (MemoryError, RuntimeError) as error:
        if not cap_mib:
            raise
        return {"failed": f"{type(error).__name__}: {str(error)[:120]}"}
    peak = status_kib("VmHWM")
    plan = binding_of(model).plan
    return {
        "step_s": statistics.median(times),
        "model_mib": (peak - before) / 1024,
        "plan_mib": plan.bytes_per_device() / 2**20,
        "params": sum(int(np.prod(v.shape)) for v in model.trainable_variables),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cap-mib", type=int, default=1600)
    args = parser.parse_args(argv)
    from keras_parallel.launcher.torch_processes import launch

    results = {}
    for kind in KINDS:
        ranks = launch(worker, 4, args=(kind, args.steps, args.batch, 0), timeout=1800)
        results[kind] = ranks
        print(
            f"{kind:10s} params {ranks[0]['params'] / 1e6:.1f} M  "
            f"step {ranks[0]['step_s']:.2f} s  memory per process "
            f"{max(r['model_mib'] for r in ranks):.0f} MiB above the baseline "
            f"(plan: {ranks[0]['plan_mib']:.0f} MiB of variables)",
            flush=True,
        )
    worst = {k: max(r["model_mib"] for r in v) for k, v in results.items()}
    ratio = worst["full"] / worst["ddp"]
    print(f"memory full / DDP: {ratio:.2f} (target <= 0.35)")
    print(f"memory optimizer / DDP: {worst['optimizer'] / worst['ddp']:.2f}")
    for kind in ("full", "optimizer"):
        speed = results[kind][0]["step_s"] / results["ddp"][0]["step_s"]
        print(f"time per step {kind} / DDP: {speed:.2f}")
    if args.cap_mib:
        for kind in ("ddp", "full"):
            try:
                ranks = launch(
                    worker, 4, args=(kind, 1, args.batch, args.cap_mib), timeout=1800
                )
                failed = [r["failed"] for r in ranks if "failed" in r]
                outcome = f"failed: {failed[0]}" if failed else "trained"
            except Exception as error:  # A rank killed or raising elsewhere.
                outcome = f"failed: {type(error).__name__}: {str(error)[:160]}"
            print(f"address space capped at +{args.cap_mib} MiB: {kind} {outcome}")
    return 0 if ratio <= 0.35 else 1


if __name__ == "__main__":
    sys.exit(main())
