"""DistributedModel DDP `fit` against the Keras guide's hand-written DDP loop.

Two gloo processes with one torch thread each, the guide's convnet
(`keras_parallel.demo.get_model`), global batch 64 and 512. For each batch
size the two ways run one epoch each, interleaved, `--rounds` times, after a
warm-up epoch of each; the median seconds per sample and their ratio are
printed (rank 0). Target: ratio at most 1.10.

- "loop": the guide's `train_model` under `DistributedDataParallel`: each
  rank iterates its contiguous half of every global batch (what the guide's
  `DistributedSampler` does, without its padding), `model(x, training=True)`,
  `torch.nn.CrossEntropyLoss`, `torch.optim.Adam`.
- "fit": `model.fit` of a `keras_parallel.DistributedModel` compiled with
  `DataParallel()`, Keras's Adam and sparse categorical cross-entropy,
  `verbose=0`.
- "loop_local" and "keras_local": the same per-rank rows with no
  communication, through the guide's loop on a plain module and through
  Keras's own `fit` (no keras_parallel). Their ratio is the Keras trainer's
  own per-step cost; what remains of fit/loop is keras_parallel's.

Usage:

    KERAS_BACKEND=torch python benchmarks/bench_torch_ddp.py [--samples 4096]

`--two-nodes` starts the two processes as two nodes of one process each
(`keras-parallel launch --nnodes 2 --node-rank R --nproc-per-node 1`, two
launchers on 127.0.0.1, torchrun's rendezvous between them: how a cluster
starts them) instead of `keras_parallel.launch`'s spawned processes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")


def _data(samples):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(samples, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int64")
    return x, y


def _loop_epoch(ddp, optimizer, loss_fn, x, y, global_batch, rank, world):
    import torch

    local = global_batch // world
    for start in range(0, len(x) - global_batch + 1, global_batch):
        s = start + rank * local
        inputs = torch.from_numpy(x[s : s + local])
        targets = torch.from_numpy(y[s : s + local])
        outputs = ddp(inputs, training=True)
        loss = loss_fn(outputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _make_loop(distributed=True):
    import torch

    from keras_parallel import demo

    model = demo.get_model()
    if not distributed:
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.Adam(params, lr=1e-3), torch.nn.CrossEntropyLoss()
    ignored = [
        name for name, p in model.named_parameters() if not p.is_floating_point()
    ]
    # gloo cannot broadcast the uint32 seed state; the guide (NCCL) can.
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ignored
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return ddp, torch.optim.Adam(params, lr=1e-3), torch.nn.CrossEntropyLoss()


def _make_fit(distributed=True):
    import keras

    import keras_parallel
    from keras_parallel import demo

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    model = demo.get_model(Net)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distribution=keras_parallel.DataParallel() if distributed else None,
    )
    return model


def _local_rows(x, global_batch, rank, world):
    """This rank's contiguous share of every global batch, concatenated."""
    import numpy as np

    local = global_batch // world
    starts = range(rank * local, len(x), global_batch)
    return np.concatenate([x[s : s + local] for s in starts])


def worker(samples, batches, rounds):
    """One rank: returns `{batch: {"loop": [s/sample], "fit": [s/sample]}}`."""
    import torch.distributed as dist

    import keras_parallel

    keras_parallel.DataParallel()  # Starts the process group.
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(samples)
    results = {}
    for batch in batches:
        used = (samples // batch) * batch
        xs, ys = x[:used], y[:used]
        ddp, optimizer, loss_fn = _make_loop()
        model = _make_fit()
        plain, plain_optimizer, plain_loss = _make_loop(distributed=False)
        plain_keras = _make_fit(distributed=False)
        x_local = _local_rows(xs, batch, rank, world)
        y_local = _local_rows(ys, batch, rank, world)

        def run_loop(
            ddp=ddp, optimizer=optimizer, loss_fn=loss_fn, xs=xs, ys=ys, batch=batch
        ):
            _loop_epoch(ddp, optimizer, loss_fn, xs, ys, batch, rank, world)

        def run_fit(model=model, xs=xs, ys=ys, batch=batch):
            model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0)

        # The same per-rank work without any communication: the guide's
        # loop on a plain module, and Keras's own fit (no keras_parallel) on
        # this rank's rows. Their ratio is the Keras trainer's own per-step
        # cost, which is not ours to cut.
        def run_loop_local(xs=xs, ys=ys, batch=batch):
            _loop_epoch(plain, plain_optimizer, plain_loss, xs, ys, batch, rank, world)

        def run_keras_local(x_local=x_local, y_local=y_local, batch=batch):
            plain_keras.fit(
                x_local,
                y_local,
                batch_size=batch // world,
                epochs=1,
                shuffle=False,
                verbose=0,
            )

        runners = (
            ("loop", run_loop),
            ("fit", run_fit),
            ("loop_local", run_loop_local),
            ("keras_local", run_keras_local),
        )
        times = {name: [] for name, _ in runners}
        for round_ in range(rounds + 1):
            for name, run in runners:
                dist.barrier()
                start = time.perf_counter()
                run()
                dist.barrier()
                if round_:  # Round 0 warms up.
                    times[name].append((time.perf_counter() - start) / used)
        results[batch] = times
    return results


def node_worker(out, samples, batches, rounds):
    """One process of a `--two-nodes` run: rank 0 writes the results to `out`."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # As keras_parallel.launch's processes.
    results = worker(samples, batches, rounds)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({str(batch): times for batch, times in results.items()}, f)


def launch_two_nodes(args):
    """Two `keras-parallel launch --nnodes 2` of one process each; rank 0's results."""
    from keras_parallel.launcher.ports import free_port

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=root)
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "results.json")
        worker_args = [
            out,
            str(args.samples),
            str(args.rounds),
            *map(str, args.batches),
        ]
        nodes = []
        for node in (0, 1):
            command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
            command += ["--backend", "torch", "--nnodes", "2", "--node-rank", str(node)]
            command += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
            command += ["--master-port", str(port), os.path.abspath(__file__)]
            nodes.append(
                subprocess.Popen([*command, "--node-worker", *worker_args], env=env)
            )
        try:
            for process in nodes:
                if process.wait(timeout=3600) != 0:
                    raise RuntimeError(f"a node's launch failed: {process.args}")
        finally:
            for process in nodes:
                if process.poll() is None:
                    process.kill()
        with open(out) as f:
            return {int(batch): times for batch, times in json.load(f).items()}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--node-worker":
        out, samples, rounds, *batches = argv[1:]
        return node_worker(out, int(samples), [int(b) for b in batches], int(rounds))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    parser.add_argument(
        "--two-nodes",
        action="store_true",
        help="two keras-parallel launch --nnodes 2 of one process each",
    )
    args = parser.parse_args(argv)
    from keras_parallel.launcher.torch_processes import launch

    if args.two_nodes:
        results = launch_two_nodes(args)
    else:
        results = launch(
            worker,
            2,
            args=(args.samples, args.batches, args.rounds),
            threads_per_process=1,
            timeout=3600,
        )[0]
    how = "2 nodes of 1 process (torchrun)" if args.two_nodes else "2 processes"
    print(
        f"{how}, gloo, 1 thread each, {args.samples} samples, "
        f"{args.rounds} interleaved rounds (median)"
    )
    print(
        f"{'global batch':>12} {'loop us/sample':>15} {'fit us/sample':>14} "
        f"{'fit/loop':>9} {'keras/loop, 1 rank, no comm':>28} {'ours':>6}"
    )
    for batch, times in results.items():
        median = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        ratio = median["fit"] / median["loop"]
        keras_own = median["keras_local"] / median["loop_local"]
        print(
            f"{batch:>12} {median['loop']:>15.1f} {median['fit']:>14.1f} "
            f"{ratio:>9.3f} {keras_own:>28.3f} {ratio / keras_own:>6.3f}"
        )
    print(
        "keras/loop: Keras's own fit against the guide's loop on one rank's "
        "rows, no communication; ours = (fit/loop) / (keras/loop)."
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
