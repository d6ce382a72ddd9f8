"""The host's own work per step: `fit` against the hand-written loops on a
model whose compute is negligible (as a step is short on an accelerator).

Dense 32 -> 64 -> 10, global batch 64, `--steps` steps an epoch, SGD. Each
way runs 2 epochs, the second timed; the ways run interleaved, `--rounds`
times; the median milliseconds per step and each way's ratio to the
backend's anchor are printed.

torch (2 gloo ranks, `keras_parallel.launch`, one torch thread each):

- "loop" (the anchor): the PyTorch guide's loop under
  `DistributedDataParallel`, each rank its half of every global batch,
  reading `loss.item()` every step (as its progress print does);
- "fit": `fit` of a `DistributedModel`, `verbose=0`;
- "fit_logs": the same with a callback that reads each batch's logs (what
  a progress bar does: the global loss every step);
- "keras_one": plain Keras `fit` in one process (no keras_parallel);
- "loop_one": the same hand-written loop in one process, no DDP, the
  whole batch: with "keras_one" and "loop", what Keras's own step costs
  and what DDP's all-reduce costs, so that `fit`'s excess over the anchor
  splits into Keras's, DDP's and keras_parallel's own.

JAX (8 simulated CPU devices, one process):

- "loop" (the anchor): the JAX guide's `jax.jit` step over a batch split
  on the devices, reading the loss every step;
- "keras_one": plain Keras `fit` (no distribution, no keras_parallel);
- "keras_dp_logs": Keras's own `set_distribution(DataParallel())` and
  `fit`, with the per-batch logs callback;
- "fit": `fit` of a `DistributedModel`, `verbose=0`;
- "fit_logs": with the per-batch logs callback.

Keras's own `DataParallel` runs with the logs callback only: with none, its
steps are dispatched ahead of each other, and XLA:CPU's 8 device threads
can then wait on each other's collectives forever (seen in this benchmark:
"Expected 8 threads to join the rendezvous", then an abort). keras_parallel
waits for each step on CPU (`one_step_at_a_time` in the JAX executor).

On JAX two numbers per way: wall milliseconds per step, and the host's own
work, the CPU milliseconds per step of the thread that runs `fit` (or the
loop): a thread waiting for the devices spends none, so this is the
Python and dispatch work per step, apart from what the devices compute
(XLA:CPU computes on threads of its own).

Usage:

    KERAS_BACKEND=torch python benchmarks/bench_host_work.py [--rounds 3]
    KERAS_BACKEND=jax python benchmarks/bench_host_work.py [--rounds 3]
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
if os.environ["KERAS_BACKEND"] == "jax":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

BATCH, FEATURES, HIDDEN, CLASSES = 64, 32, 64, 10


def _data(steps):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(steps * BATCH,)).astype("int32")
    return x, y


def _model(distributed):
    import keras

    import keras_parallel

    keras.utils.set_random_seed(0)
    base = keras.Model
    if distributed:

        class Net(keras_parallel.DistributedModel, keras.Model):
            pass

        base = Net
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(HIDDEN, activation="relu")(inputs)
    model = base(inputs, keras.layers.Dense(CLASSES)(hidden))
    options = {"distribution": keras_parallel.DataParallel()} if distributed else {}
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **options,
    )
    return model


class _ReadsLogs:
    """A callback reading every batch's logs, as a progress bar does."""

    def __new__(cls):
        import keras

        class ReadsLogs(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                float(logs["loss"])

        return ReadsLogs()


def fit_seconds(model, x, y, callbacks=(), batch=BATCH, epochs=2):
    """The last of `epochs` epochs, timed (`benchmarks/gpu_check.py` too)."""
    return fit_times(model, x, y, callbacks, batch, epochs)[0]


def fit_times(model, x, y, callbacks=(), batch=BATCH, epochs=2):
    """`(wall seconds, CPU seconds of fit's thread)` of the last of `epochs`."""
    import keras

    times = []

    class Timer(keras.callbacks.Callback):
        # Keras calls the epoch hooks in the thread that runs `fit`.
        def on_epoch_begin(self, epoch, logs=None):
            self.start = (time.perf_counter(), time.thread_time())

        def on_epoch_end(self, epoch, logs=None):
            wall, cpu = self.start
            times.append((time.perf_counter() - wall, time.thread_time() - cpu))

    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[Timer(), *callbacks],
    )
    return times[-1]


# ------------------------------------------------------------------ torch
def _torch_loop_seconds(x, y, rank, world):
    import torch

    model = _model(distributed=False)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp = model
    if world > 1:
        ignored = [n for n, p in model.named_parameters() if not p.is_floating_point()]
        # gloo cannot broadcast an integer seed state; the guide (NCCL) can.
        ddp_class = torch.nn.parallel.DistributedDataParallel
        ddp_class._set_params_and_buffers_to_ignore_for_model(model, ignored)
        ddp = ddp_class(model)
    optimizer = torch.optim.SGD(params, lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    local = BATCH // world
    seconds = 0.0
    for _epoch in range(2):
        start = time.perf_counter()
        for s in range(0, len(x), BATCH):
            r = s + rank * local
            inputs = torch.from_numpy(x[r : r + local])
            targets = torch.from_numpy(y[r : r + local]).long()
            loss = loss_fn(ddp(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()
        seconds = time.perf_counter() - start
    return seconds


def _torch_way(way, steps):
    import torch
    import torch.distributed as dist

    import keras_parallel

    torch.set_num_threads(1)
    x, y = _data(steps)
    if way == "keras_one":
        return fit_seconds(_model(distributed=False), x, y)
    if way == "loop_one":
        return _torch_loop_seconds(x, y, 0, 1)
    keras_parallel.DataParallel()  # Starts the process group.
    rank, world = dist.get_rank(), dist.get_world_size()
    if way == "loop":
        return _torch_loop_seconds(x, y, rank, world)
    callbacks = [_ReadsLogs()] if way == "fit_logs" else []
    return fit_seconds(_model(distributed=True), x, y, callbacks)


def _torch_round(steps):
    from keras_parallel.launcher.torch_processes import launch

    out = {}
    for way in ("loop", "fit", "fit_logs"):
        out[way] = max(launch(_torch_way, 2, args=(way, steps), timeout=600))
    out["keras_one"] = _torch_way("keras_one", steps)
    out["loop_one"] = _torch_way("loop_one", steps)
    return out


# -------------------------------------------------------------------- JAX
def _jax_loop_times(x, y):
    return jax_loop_seconds(_model(distributed=False), x, y, BATCH, cpu=True)


def jax_loop_seconds(model, x, y, batch, cpu=False):
    """The JAX guide's `jax.jit` loop over `model`, 2 epochs of batches
    split on the devices, the loss read every step: the second's seconds,
    and with `cpu`, `(seconds, CPU seconds of this thread)`.
    (`benchmarks/gpu_check.py` runs it too.)"""
    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mesh = jax.make_mesh((len(jax.devices()),), ("batch",))
    split = NamedSharding(mesh, PartitionSpec("batch"))
    whole = NamedSharding(mesh, PartitionSpec())
    trainable = jax.device_put([v.value for v in model.trainable_variables], whole)
    fixed = jax.device_put([v.value for v in model.non_trainable_variables], whole)

    @jax.jit
    def step(trainable, fixed, inputs, targets):
        def loss(trainable):
            outputs, _ = model.stateless_call(trainable, fixed, inputs)
            return loss_fn(targets, outputs)

        value, grads = jax.value_and_grad(loss)(trainable)
        return value, [v - 0.01 * g for v, g in zip(trainable, grads, strict=True)]

    seconds = cpu_seconds = 0.0
    for _epoch in range(2):
        start, cpu_start = time.perf_counter(), time.thread_time()
        for s in range(0, len(x), batch):
            inputs = jax.device_put(x[s : s + batch], split)
            targets = jax.device_put(y[s : s + batch], split)
            value, trainable = step(trainable, fixed, inputs, targets)
            float(value)
        seconds = time.perf_counter() - start
        cpu_seconds = time.thread_time() - cpu_start
    return (seconds, cpu_seconds) if cpu else seconds


def _jax_round(steps):
    """`{way: (wall seconds, CPU seconds)}`, the ways interleaved."""
    import keras

    x, y = _data(steps)
    out = {"loop": _jax_loop_times(x, y)}
    out["keras_one"] = fit_times(_model(distributed=False), x, y)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        out["keras_dp_logs"] = fit_times(
            _model(distributed=False), x, y, [_ReadsLogs()]
        )
    finally:
        keras.distribution.set_distribution(None)
    out["fit"] = fit_times(_model(distributed=True), x, y)
    out["fit_logs"] = fit_times(_model(distributed=True), x, y, [_ReadsLogs()])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args()
    backend = os.environ["KERAS_BACKEND"]
    run_round = _jax_round if backend == "jax" else _torch_round
    rounds = [run_round(args.steps) for _ in range(args.rounds)]

    def per_step(way, index=None):
        values = [r[way] if index is None else r[way][index] for r in rounds]
        return statistics.median(values) / args.steps * 1000

    report = {}
    for way in rounds[0]:
        if backend == "jax":
            wall, cpu = per_step(way, 0), per_step(way, 1)
            anchor, cpu_anchor = per_step("loop", 0), per_step("loop", 1)
            report[way] = {
                "ms/step": round(wall, 3),
                "ratio to loop": round(wall / anchor, 3),
                "host CPU ms/step": round(cpu, 3),
                "host CPU ratio to loop": round(cpu / cpu_anchor, 3),
                "host CPU ms/step, each round": [
                    round(r[way][1] / args.steps * 1000, 3) for r in rounds
                ],
            }
        else:
            value = per_step(way)
            report[way] = {
                "ms/step": round(value, 3),
                "ratio to loop": round(value / per_step("loop"), 3),
            }
    print(backend, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
