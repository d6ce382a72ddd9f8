"""`Auto` on torch: each candidate's prediction against the step's real peak.

For an MLP and a small KerasHub Llama (the layout tests' models), on 2 and 4
gloo processes: every candidate is predicted on rank 0 as `Auto` predicts it
(`backends/torch/step_memory.py`: one measured step on two small batches,
then the plan), then trained with `fit` under that candidate given by hand,
and one later step's real peak is measured on rank 0 by torch's own profiler
(its allocator's events, `profile_memory=True`): the bytes of the state the
process holds (its variables' local tensors, and DDP's gradient buckets as
DDP reports them) plus the most the step allocated above its start. Printed:
predicted, measured, the error; and the seconds from `fit` to the first batch
with `Auto` against the chosen distribution given by hand.

Usage:

    python benchmarks/bench_auto_torch.py [--processes 2 4] [--models mlp llama]
"""

import argparse
import os
import sys

from keras_parallel.keras_seam.model_state import binding_of

os.environ["KERAS_BACKEND"] = "torch"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

BATCH = 64


def _model(name):
    import keras

    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    keras.utils.set_random_seed(3)
    if name == "llama":
        import hub_models

        return hub_models.model("llama", model_class=Net)
    inputs = keras.Input((256,))
    x = keras.layers.Dense(1024, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(1024, activation="relu", name="d2")(x)
    return Net(inputs, keras.layers.Dense(256, name="d3")(x))


def _data(name):
    import numpy as np

    if name == "llama":
        import hub_models

        return hub_models.batch("llama", 4 * BATCH)
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(4 * BATCH, 256)).astype("float32"),
        rng.normal(size=(4 * BATCH, 256)).astype("float32"),
    )


def _first_rows(x, rows):
    if isinstance(x, dict):
        return {k: v[:rows] for k, v in x.items()}
    return x[:rows]


def _predictions(name):
    """Every candidate's `(name, StepMemory)`, as `Auto` predicts it."""
    import keras

    import keras_parallel
    from keras_parallel.auto import choice as auto_choice
    from keras_parallel.backends import executor_class, resolve_plan_for

    model = _model(name)
    model.compile(optimizer="adam", loss="mse")
    x, y = _data(name)
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=1, verbose=0)
    for v in model.trainable_variables:
        v.value.grad = None
    batch = (_first_rows(x, BATCH), y[:BATCH], None)
    cls = executor_class()
    out = []
    for label, distribution in auto_choice.candidates(cls, cls.list_devices()):
        try:
            plan = resolve_plan_for(distribution, model)
        except keras_parallel.ShardingError as error:
            out.append((label, None, str(error)[:60]))
            continue
        out.append((label, cls.step_memory(model, distribution, plan, batch), None))
    del keras
    return out


def _profiled_peak(model, x, y):
    """The state's bytes plus the most one `fit` step allocates above them."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    for v in model.trainable_variables:
        v.value.grad = None
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.fit(_first_rows(x, BATCH), y[:BATCH], batch_size=BATCH, verbose=0)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    state = 0
    seen = set()
    variables = list(model.variables) + list(model.optimizer.variables)
    variables += list(model.metrics_variables)
    for variable in variables:
        value = variable.value
        local = value.to_local() if hasattr(value, "to_local") else value
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            state += storage.nbytes()
    buckets = 0
    executor = binding_of(model).executor
    ddp = getattr(executor, "_ddp", None)
    if ddp is not None:
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        buckets = sum(int(s) for s in str(sizes).split(",") if s.strip())
    del torch
    return state + buckets + peak


def measure(name):
    """On every rank: each candidate predicted, then trained and measured."""
    import keras

    from keras_parallel.auto import choice as auto_choice
    from keras_parallel.backends import executor_class

    predicted = _predictions(name)
    cls = executor_class()
    rows = []
    x, y = _data(name)
    for (label, distribution), (_, memory, refused) in zip(
        auto_choice.candidates(cls, cls.list_devices()), predicted, strict=True
    ):
        if memory is None:
            rows.append((label, None, None, None, refused))
            continue
        model = _model(name)
        model.compile(optimizer="adam", loss="mse", distribution=distribution)
        model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)
        # The most of three steps: the garbage collector frees some of a
        # step's temporaries, at moments that vary between steps.
        measured = max(_profiled_peak(model, x, y) for _ in range(3))
        rows.append((label, memory.peak, measured, memory.moved, None))
        del model
    del keras
    return rows


def first_batch_seconds(name, budget):
    """Seconds from `fit` to its first batch: `Auto`, then the chosen by hand."""
    from first_batch_timing import seconds_to_first_batch

    import keras_parallel

    def to_first_batch(distribution):
        model = _model(name)
        model.compile(optimizer="adam", loss="mse", distribution=distribution)
        x, y = _data(name)
        return seconds_to_first_batch(model, x, y, BATCH), model.distribution

    auto_seconds, chosen = to_first_batch(
        keras_parallel.Auto(device_memory=budget, headroom=0)
    )
    hand_seconds, _ = to_first_batch(chosen)
    return auto_seconds, hand_seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=["mlp", "llama"])
    args = parser.parse_args()
    import bench_auto_torch as me

    from keras_parallel.launcher.torch_processes import launch
    from keras_parallel.report import format_bytes

    for processes in args.processes:
        for name in args.models:
            rows = launch(me.measure, processes, args=(name,), timeout=900)[0]
            print(f"\n{name}, {processes} processes, global batch {BATCH}")
            print("| candidate | predicted | measured | error | moved/step |")
            print("| --- | --- | --- | --- | --- |")
            fitting = []
            for label, peak, measured, moved, refused in rows:
                if peak is None:
                    print(f"| {label} | - | - | - | ({refused}) |")
                    continue
                error = (peak - measured) / measured
                fitting.append(peak)
                print(
                    f"| {label} | {format_bytes(peak)} | {format_bytes(measured)} "
                    f"| {error:+.1%} | {format_bytes(moved)} |"
                )
            # A budget the first candidate misses and a later one fits:
            # half-way, as the first `fit` measures its step anew.
            smaller = [p for p in fitting[1:] if p < fitting[0]]
            if smaller:
                auto_s, hand_s = launch(
                    me.first_batch_seconds,
                    processes,
                    args=(name, (max(smaller) + fitting[0]) // 2),
                    timeout=600,
                )[0]
                print(
                    f"fit to first batch: Auto {auto_s:.2f} s, by hand "
                    f"{hand_s:.2f} s, choosing {auto_s - hand_s:.2f} s"
                )


if __name__ == "__main__":
    main()
