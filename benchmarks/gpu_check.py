"""A ready check for one lent GPU: speed, MFU, collectives and host syncs.

Prints one table, in about 8 minutes on one GPU (seconds with `--dry-run`
on CPU, which the test suite runs: `tests/test_gpu_check.py`):

(a) torch, one process: plain Keras `fit`, keras_parallel `fit` (a
    `DistributedModel` under `DataParallel` on a process group of one,
    NCCL on a GPU: the distributed path runs whole, DDP included) and the
    PyTorch guide's hand-written loop, milliseconds per step of a small
    model (Dense 32 -> 64 -> 10, batch 64: the host's own work) and a
    medium one (a stack of transformer blocks, bf16 mixed precision on a
    GPU), and the medium one's MFU (`keras_parallel.throughput`'s FLOPs
    estimate against the card's peak);
(b) the same on JAX: plain Keras `fit`, keras_parallel `fit` and the JAX
    guide's `jax.jit` loop;
(c) every collective of the torch executor, run once on the process group
    of one (NCCL on a GPU takes CUDA tensors only: a CPU tensor handed to
    it fails here): the executor's `reduce`, `broadcast`, `barrier` and
    key-value store, and, through the keras_parallel `fit` of (a), the
    gradient, metric, batch-check and predict all-reduces and gathers;
(d) the host syncs a torch step makes on the GPU
    (`torch.cuda.set_sync_debug_mode`), keras_parallel's `fit` against
    plain Keras's (n/a on CPU).

Each backend runs in a process of its own (`KERAS_BACKEND` is fixed per
process); a part that fails prints its error in the table and the others
still run.

Usage:

    python benchmarks/gpu_check.py            # on the GPU machine
    python benchmarks/gpu_check.py --dry-run  # anywhere: tiny sizes, CPU
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback

from keras_parallel.keras_seam.model_state import binding_of

#: `(steps timed, small batch, medium: batch, sequence, width, blocks)`.
SIZES = {
    "full": (64, 64, (32, 256, 768, 6)),
    "dry": (3, 8, (8, 8, 16, 1)),
}


# ------------------------------------------------------------------ models
def _small_model(distributed):
    import keras

    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return _compiled(keras.Model, distributed, inputs, keras.layers.Dense(10)(hidden))


def _medium_model(distributed, sizes):
    """A stack of pre-norm transformer blocks, random weights."""
    import keras

    _, sequence, width, blocks = sizes
    inputs = keras.Input((sequence, width))
    x = inputs
    for _ in range(blocks):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(max(1, width // 64), min(64, width))(h, h)
        x = x + h
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * width, activation="gelu")(h)
        x = x + keras.layers.Dense(width)(h)
    pooled = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(10, dtype="float32")(pooled)
    return _compiled(keras.Model, distributed, inputs, outputs)


def _compiled(base, distributed, inputs, outputs):
    import keras

    import keras_parallel

    keras.utils.set_random_seed(0)
    if distributed:

        class Net(keras_parallel.DistributedModel, keras.Model):
            pass

        base = Net
    model = base(inputs, outputs)
    options = {"distribution": keras_parallel.DataParallel()} if distributed else {}
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **options,
    )
    return model


def _data(model, batch, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (batch * steps, *model.inputs[0].shape[1:])
    x = rng.normal(size=shape).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,)).astype("int32")
    return x, y


def _fit_ms(model, x, y, batch, steps):
    """Milliseconds per step of `fit`'s third epoch: on one JAX device
    under a distribution (Keras's own `DataParallel` too) the step compiles
    again in the first two (the state turns committed, then the metrics'
    reset zeros do not)."""
    from bench_host_work import fit_seconds

    return 1000 * fit_seconds(model, x, y, batch=batch, epochs=3) / steps


def _mfu(model, batch, ms):
    from keras_parallel import throughput

    flops = throughput.train_flops_per_sample(model)
    peak = throughput.device_peak_flops(model)
    if not flops or not peak:
        return None
    return flops * batch / (ms / 1000) / peak


# ------------------------------------------------------------------- torch
def _torch_part(size):
    import torch

    cuda = torch.cuda.is_available()

    def more(row, parallel, build, x, y, batch):
        parallel.evaluate(x[:batch], y[:batch], batch_size=batch, verbose=0)
        parallel.predict(x[:batch], batch_size=batch, verbose=0)
        # The distributed path ran: DDP wraps the model (made after the
        # first step, once every variable had a gradient).
        row["DDP"] = binding_of(parallel).executor._ddp is not None
        if cuda:
            row["syncs/step keras"] = _torch_syncs(build(False), x, y, batch)
            row["syncs/step keras_parallel"] = _torch_syncs(build(True), x, y, batch)

    rows = {"collectives": _torch_collectives()}
    rows.update(_model_rows(size, cuda, _torch_loop_ms, more))
    return rows


def _model_rows(size, accelerator, loop_ms, more=None):
    """`{"small": row, "medium": row}`: each model's milliseconds per step
    of plain Keras `fit`, keras_parallel `fit` and the hand loop, and MFU;
    `more(row, parallel model, build, x, y, batch)` adds a backend's own."""
    import keras

    steps, small_batch, medium = SIZES[size]
    rows = {}
    for name, batch, build in (
        ("small", small_batch, lambda d: _small_model(d)),
        ("medium", medium[0], lambda d: _medium_model(d, medium)),
    ):
        keras.mixed_precision.set_global_policy(
            "mixed_bfloat16" if accelerator and name == "medium" else "float32"
        )
        row = {}
        x, y = _data(build(False), batch, steps)
        row["keras fit"] = _fit_ms(build(False), x, y, batch, steps)
        parallel = build(True)
        row["keras_parallel fit"] = _fit_ms(parallel, x, y, batch, steps)
        row["hand loop"] = loop_ms(build(False), x, y, batch, steps)
        row["MFU (keras_parallel)"] = _mfu(parallel, batch, row["keras_parallel fit"])
        if more is not None:
            more(row, parallel, build, x, y, batch)
        rows[name] = row
    return rows


def _one_process_group_env():
    """The variables of a torch group of one process that runs the whole
    distributed path (`KERAS_PARALLEL_ONE_PROCESS_GROUP`; NCCL on a GPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "KERAS_PARALLEL_ONE_PROCESS_GROUP": "1",
    }


def _torch_collectives():
    """Each collective of the executor once; `{name: "ok" or the error}`."""
    import numpy as np
    import torch

    import keras_parallel
    from keras_parallel.backends.torch import group as torch_group
    from keras_parallel.backends.torch.executor import TorchExecutor

    executor = TorchExecutor(keras_parallel.DataParallel())  # Starts the group.
    if executor.num_processes != 1 or not torch_group.is_distributed():
        raise RuntimeError("the check needs a distributed group of one process")
    checks = {
        "reduce (float)": lambda: executor.reduce(2.0),
        "reduce (array, sum)": lambda: executor.reduce(np.ones(3), op="sum"),
        "reduce (tensor)": lambda: executor.reduce(torch.ones(3)),
        "broadcast": lambda: executor.broadcast({"step": 1}),
        "barrier": executor.barrier,
        "key-value store": lambda: _store_round_trip(executor.key_value_store()),
    }
    out = {}
    for name, check in checks.items():
        try:
            check()
            out[name] = "ok"
        except Exception as error:  # Reported in the table, not raised.
            out[name] = f"{type(error).__name__}: {error}"[:200]
    return out


def _store_round_trip(store):
    store.set("gpu_check", "1")
    if store.try_get("gpu_check") != "1":
        raise RuntimeError("the key-value store lost a value")


def _torch_loop_ms(model, x, y, batch, steps):
    """The PyTorch guide's loop (one process: no DDP wrapper)."""
    import torch

    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    seconds = 0.0
    for _epoch in range(2):
        start = time.perf_counter()
        for s in range(0, batch * steps, batch):
            inputs = torch.from_numpy(x[s : s + batch]).to(device)
            targets = torch.from_numpy(y[s : s + batch]).long().to(device)
            loss = loss_fn(model(inputs).float(), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()  # The guide's progress print.
        seconds = time.perf_counter() - start
    return 1000 * seconds / steps


def _torch_syncs(model, x, y, batch, steps=4):
    """Host syncs per step of `fit`, counted by torch's sync debug mode."""
    import warnings

    import torch

    model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)  # Built.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(
                x[: batch * steps], y[: batch * steps], batch_size=batch, verbose=0
            )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught) / steps


# --------------------------------------------------------------------- JAX
def _jax_part(size):
    import jax

    return _model_rows(size, jax.devices()[0].platform == "gpu", _jax_loop_ms)


def _jax_loop_ms(model, x, y, batch, steps):
    """The JAX guide's `jax.jit` step over a batch split on the devices."""
    from bench_host_work import jax_loop_seconds

    return 1000 * jax_loop_seconds(model, x, y, batch) / steps


# ----------------------------------------------------------------- driver
PARTS = {"torch": _torch_part, "jax": _jax_part}


def _run_part(backend, size):
    """One backend's rows, from a process of its own."""
    env = dict(os.environ, KERAS_BACKEND=backend)
    if backend == "torch":
        env.update(_one_process_group_env())
    if size == "dry":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, os.path.abspath(__file__), "--part", backend]
    command += ["--size", size]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=420
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 420 s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1])


def _device_name():
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def table(results, device):
    """The report: one Markdown table of every backend's rows."""
    lines = [f"device: {device or 'CPU (no GPU found)'}", ""]
    lines += ["| backend | model | measure | value |", "| --- | --- | --- | --- |"]
    for backend, rows in results.items():
        for model, row in rows.items():
            if not isinstance(row, dict):
                row = {"": row}
            for measure, value in row.items():
                if isinstance(value, float):
                    value = f"{value:.3f}"
                lines.append(f"| {backend} | {model} | {measure} | {value} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, on CPU")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        try:
            rows = PARTS[args.part](args.size)
        except Exception:
            traceback.print_exc()
            return 1
        print(json.dumps(rows))
        return 0
    size = "dry" if args.dry_run else "full"
    device = "" if args.dry_run else _device_name()
    results = {backend: _run_part(backend, size) for backend in PARTS}
    print(table(results, device))
    failed = [
        f"{backend}: {rows['error']}"
        for backend, rows in results.items()
        if "error" in rows
    ]
    failed += [
        f"torch collective {name}: {outcome}"
        for name, outcome in results.get("torch", {}).get("collectives", {}).items()
        if outcome != "ok"
    ]
    if failed:
        print("\nFAILED:\n" + "\n".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
