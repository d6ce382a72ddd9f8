"""Layouts derived from the model against written ones, on JAX's 8 devices.

A KerasHub Llama stack (random, no download; grouped-query attention with 2
key/value heads) trains with `model.fit` under, side by side in one run:

- `data_parallel`: `keras_parallel.DataParallel()` over the 8 devices;
- `megatron`: a hand-written Megatron `LayoutMap` on a `(data=2, model=4)`
  mesh: attention split by heads (key/value whole: 2 heads do not divide 4),
  the MLP's up and gate projections by columns, its down projection by rows,
  the embeddings by vocabulary;
- `auto`: `keras_parallel.ModelParallel(rules="auto")`, no map written;
- `keras_hub`: KerasHub's own `LlamaBackbone.get_layout_map` (which splits
  over both axes);
- `auto_full`: `rules="auto"` with `shard="full"` (both axes, as KerasHub's).

For each it prints the median seconds per step (after a warm-up step), the
bytes of model and optimizer variables one device holds, and the
collectives of the compiled step read from its optimized HLO: how many, and
the bytes they move. On CPU the step time says little about an accelerator
(the simulated devices share 2 cores); the bytes and the collectives are
what carries over.

Usage:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 KERAS_BACKEND=jax \\
        python benchmarks/bench_derived_layouts.py [--steps 5] [--layers 4]
"""

import argparse
import os
import re
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

HIDDEN, HEADS, KV_HEADS, FFW, VOCAB, SEQ, BATCH = 256, 8, 2, 1024, 2048, 64, 16
KINDS = ("data_parallel", "megatron", "auto", "keras_hub", "auto_full")
COLLECTIVE = re.compile(
    r"= (\(?[a-z0-9]+\[[0-9,]*\].*?) "
    r"(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(-start)?\("
)


def build(layers):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    hub = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=layers,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=FFW,
    )
    return keras.Model(hub.input, hub.output)


def megatron_map(mesh):
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = ("model", None)
    layout_map["token_embedding/reverse_embeddings"] = (None, "model")
    layout_map[".*self_attention/query/kernel"] = (None, "model", None)
    layout_map[".*self_attention/attention_output/kernel"] = ("model", None, None)
    layout_map[".*feedforward_(intermediate|gate)_dense/kernel"] = (None, "model")
    layout_map[".*feedforward_output_dense/kernel"] = ("model", None)
    return layout_map


def distribution(kind):
    import keras
    import keras_hub

    import keras_parallel

    if kind == "data_parallel":
        return keras_parallel.DataParallel()
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ["data", "model"], keras.distribution.list_devices()
    )
    if kind == "megatron":
        return keras_parallel.ModelParallel(
            layout_map=megatron_map(mesh), batch_dim_name="data"
        )
    if kind == "keras_hub":
        layout_map = keras_hub.models.LlamaBackbone.get_layout_map(
            mesh, model_parallel_dim_name="model", data_parallel_dim_name="data"
        )
        return keras_parallel.ModelParallel(
            layout_map=layout_map, batch_dim_name="data"
        )
    shard = "full" if kind == "auto_full" else None
    return keras_parallel.ModelParallel(
        device_mesh=mesh, rules="auto", batch_dim_name="data", shard=shard
    )


class StepTimes:
    """Wall seconds of each training batch (the first is the warm-up)."""

    def __init__(self):
        import keras

        class Times(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds = []

            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)

        self.callback = Times()


def collectives(compiled, args):
    count, moved = 0, 0
    for line in compiled.lower(*args).compile().as_text().splitlines():
        match = COLLECTIVE.search(line)
        if match:
            count += 1
            for bits, dims in re.findall(r"[a-z]+(\d+)\[([0-9,]*)\]", match.group(1)):
                size = 1
                for d in dims.split(","):
                    size *= int(d) if d else 1
                moved += size * int(bits) // 8
    return count, moved


def run(kind, layers, steps):
    import keras
    import numpy as np

    import keras_parallel
    from keras_parallel.backends.jax import batches

    recorded = []
    original = batches.jit_splitting_batches

    def recording(function, *args, **kwargs):
        compiled = original(function, *args, **kwargs)

        def call(*step_args):
            recorded[:] = [(compiled, step_args)]
            return compiled(*step_args)

        return call

    batches.jit_splitting_batches = recording
    try:
        model = build(layers)
        rng = np.random.default_rng(0)
        n = BATCH * (steps + 1)
        x = {
            "token_ids": rng.integers(0, VOCAB, (n, SEQ)).astype("int32"),
            "padding_mask": np.ones((n, SEQ), "int32"),
        }
        y = rng.normal(size=(n, SEQ, HIDDEN)).astype("float32")
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        times = StepTimes()
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras_parallel.ShardingCallback(distribution(kind)),
                times.callback,
            ],
        )
        held = sum(
            v.value.addressable_shards[0].data.nbytes
            for v in model.weights + model.optimizer.variables
        )
        count, moved = collectives(*recorded[-1])
    finally:
        batches.jit_splitting_batches = original
    return statistics.median(times.callback.seconds[1:]), held, count, moved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    results = {kind: run(kind, args.layers, args.steps) for kind in KINDS}
    base_seconds, base_bytes, _, _ = results["data_parallel"]
    print(
        f"KerasHub Llama, {args.layers} blocks, hidden {HIDDEN}, {HEADS} heads "
        f"({KV_HEADS} key/value), batch {BATCH} x {SEQ} tokens, 8 CPU devices"
    )
    print(
        f"{'layout':14s} {'s/step':>8s} {'x DP':>6s} {'MiB/device':>11s} "
        f"{'x DP':>6s} {'collectives':>12s} {'MiB moved':>10s}"
    )
    for kind, (seconds, held, count, moved) in results.items():
        print(
            f"{kind:14s} {seconds:8.4f} {seconds / base_seconds:6.2f} "
            f"{held / 2**20:11.2f} {held / base_bytes:6.2f} {count:12d} "
            f"{moved / 2**20:10.2f}"
        )


if __name__ == "__main__":
    main()
