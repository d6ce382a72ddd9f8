"""Which candidate `Auto` chooses: the candidates in order, each predicted,
the first that fits (`keras_parallel.auto.auto` is what the user gives).
"""

import dataclasses

from keras_parallel.errors import ShardingError
from keras_parallel.report import format_bytes

#: Why a candidate after the chosen one has no prediction.
NOT_PREDICTED = "not predicted: an earlier candidate fits"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate distribution and what it was predicted to take.

    Attributes:
        name: how it is written (`'DataParallel(shard="full")'`).
        distribution: the distribution itself.
        bytes_per_device: the predicted peak bytes of one device in a train
            step, or None where the candidate cannot run this model.
        state_bytes: of which the variables, optimizer and metric state
            the plan puts on one device (exact).
        bytes_moved: the bytes one device sends in the step's collectives.
        refused: why the candidate cannot run this model, if so.
    """

    name: str
    distribution: object
    bytes_per_device: int = None
    state_bytes: int = None
    bytes_moved: int = None
    refused: str = None

    def fits(self, budget):
        return self.bytes_per_device is not None and self.bytes_per_device <= budget


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `Auto` chose, and from what.

    Attributes:
        candidates: every `Candidate`, in order.
        chosen: the one chosen (the first that fits).
        budget: the bytes per device a candidate could take.
        batch: the global batch's description (`"64 rows"`).
        seconds: how long the predictions took.
    """

    candidates: tuple
    chosen: Candidate
    budget: int
    batch: str
    seconds: float
    note: str = None

    def table(self):
        """The candidates as a text table, and which was chosen and why."""
        rows = [("candidate", "bytes/device", "state", "moved/step", "fits")]
        for c in self.candidates:
            if c.refused == NOT_PREDICTED:
                rows.append((c.name, "-", "-", "-", f"({c.refused})"))
                continue
            if c.bytes_per_device is None:
                rows.append((c.name, "-", "-", "-", f"no: {c.refused}"))
                continue
            rows.append(
                (
                    c.name,
                    format_bytes(c.bytes_per_device),
                    format_bytes(c.state_bytes),
                    format_bytes(c.bytes_moved),
                    "yes" if c.fits(self.budget) else "no",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
            + "  "
            + row[4]
            for row in rows
        ]
        earlier = self.candidates.index(self.chosen)
        why = (
            "the first candidate, and it fits"
            if earlier == 0
            else f"the first that fits; the {earlier} before it move less "
            "but do not fit or cannot run this model"
        )
        return "\n".join(
            [
                f"keras_parallel Auto: budget {format_bytes(self.budget)} per "
                f"device, global batch {self.batch}, predicted in "
                f"{self.seconds:.1f} s",
                *("  " + line.rstrip() for line in lines),
                f"chosen: {self.chosen.name} ({why})",
                *([f"note: {self.note}"] if self.note else []),
            ]
        )


def candidates(executor_class, devices):
    """`[(name, distribution)]` of `Auto`'s candidates over `devices`.

    Args:
        executor_class: the backend's executor class
            (its `auto_support.candidate_kinds` limits which kinds it runs).
        devices: the device names every candidate spans.
    """
    import keras

    from keras_parallel.distribution import DataParallel, ModelParallel

    kinds = executor_class.auto_support.candidate_kinds
    out = [("DataParallel()", DataParallel(devices=devices))]
    if "shard" in kinds:
        out += [
            (
                f'DataParallel(shard="{shard}")',
                DataParallel(devices=devices, shard=shard),
            )
            for shard in ("optimizer", "full")
        ]
    if "model" in kinds:
        count = len(devices)
        splits = [m for m in range(2, count + 1) if count % m == 0]
        for shard in (None, "full"):
            for model_size in splits:
                mesh = keras.distribution.DeviceMesh(
                    (count // model_size, model_size), ["data", "model"], devices
                )
                shard_text = f', shard="{shard}"' if shard else ""
                name = (
                    f"ModelParallel(mesh=({count // model_size}, {model_size}), "
                    f'rules="auto"{shard_text})'
                )
                out.append(
                    (
                        name,
                        ModelParallel(
                            device_mesh=mesh,
                            rules="auto",
                            batch_dim_name="data",
                            shard=shard,
                        ),
                    )
                )
    return out


def choose(auto, model, batch, executor_class, devices, predict_all=False):
    """Predicts the candidates in order and chooses the first that fits.

    Args:
        auto: the `Auto`.
        model: the built model, its optimizer and metrics built.
        batch: the global batch, a nest of arrays or specs (`shape`,
            `dtype`) of `(x, y, sample_weight)`.
        executor_class: the backend's executor class.
        devices: the device names the candidates span.
        predict_all: predict every candidate (a full table); by default
            those after the chosen one are not compiled (one compilation
            when plain data parallelism fits).

    Returns:
        The `Choice`.

    Raises:
        ValueError: `auto` has no budget, or no candidate fits (naming the
            smallest need, the budget and the largest variable). Nothing was
            moved.
    """
    import time

    from keras_parallel.backends import resolve_plan_for

    budget = auto.budget(executor_class)
    start = time.perf_counter()
    predicted = []
    notes = []
    for name, distribution in candidates(executor_class, devices):
        if not predict_all and first_fitting(predicted, budget) is not None:
            predicted.append(Candidate(name, distribution, refused=NOT_PREDICTED))
            continue
        try:
            plan = resolve_plan_for(distribution, model)
        except ShardingError as error:
            predicted.append(Candidate(name, distribution, refused=_first_line(error)))
            continue
        memory = executor_class.step_memory(model, distribution, plan, batch)
        note = getattr(memory, "note", None)
        if note and note not in notes:
            notes.append(note)
        predicted.append(
            Candidate(
                name,
                distribution,
                bytes_per_device=memory.peak,
                state_bytes=plan.bytes_per_device(("model", "optimizer", "metric")),
                bytes_moved=memory.moved,
            )
        )
    seconds = time.perf_counter() - start
    chosen = first_fitting(predicted, budget)
    if chosen is None:
        raise _nothing_fits(model, predicted, budget)
    return Choice(
        tuple(predicted),
        chosen,
        budget,
        _batch_text(batch),
        seconds,
        "; ".join(notes) or None,
    )


def choose_agreed(auto, model, batch, executor_class, devices):
    """`choose`, made by the chief process and given to every other.

    On one process, `choose` itself. With several, only process 0 predicts
    (a torch prediction measures a step), and sends its table as JSON (data,
    never code) so that every process applies the same distribution; a
    refusal reaches every process as the same error.

    Args:
        auto: the `Auto`.
        model: the built model.
        batch: the global batch.
        executor_class: the backend's executor class.
        devices: the device names the candidates span.

    Returns:
        The `Choice`.
    """
    import json

    from keras_parallel.distribution import DataParallel

    # The collectives of the first candidate's executor: no run is made
    # with it (`Binding.choose` makes the chosen one's).
    executor = executor_class(DataParallel(devices=devices))
    if executor.num_processes <= 1:
        return choose(auto, model, batch, executor_class, devices)
    choice, message, raised = None, {}, None
    if executor.is_chief:
        try:
            choice = choose(auto, model, batch, executor_class, devices)
            message = {
                "rows": [
                    [c.bytes_per_device, c.state_bytes, c.bytes_moved, c.refused]
                    for c in choice.candidates
                ],
                "budget": choice.budget,
                "batch": choice.batch,
                "seconds": choice.seconds,
                "note": choice.note,
            }
        except Exception as error:  # Every process raises it alike.
            raised = error
            message = {"error": str(error), "type": type(error).__name__}
    received = json.loads(executor.broadcast_bytes(json.dumps(message).encode()))
    if raised is not None:
        raise raised
    if "error" in received:
        kind = ValueError if received.get("type") == "ValueError" else RuntimeError
        raise kind(f"(process 0 chose) {received['error']}")
    if choice is not None:
        return choice
    predicted = [
        Candidate(name, distribution, *row)
        for (name, distribution), row in zip(
            candidates(executor_class, devices), received["rows"], strict=True
        )
    ]
    budget = int(received["budget"])
    return Choice(
        tuple(predicted),
        first_fitting(predicted, budget),
        budget,
        str(received["batch"]),
        float(received["seconds"]),
        received.get("note"),
    )


def first_fitting(predicted, budget):
    """The first `Candidate` of `predicted` that fits `budget`, or None."""
    return next((c for c in predicted if c.fits(budget)), None)


def _first_line(error):
    return str(error).split(". ")[0].split("\n")[0][:80]


def _batch_text(batch):
    import keras

    if batch is None:
        return "not needed"

    leaves = [leaf for leaf in keras.tree.flatten(batch) if leaf is not None]
    rows = {int(leaf.shape[0]) for leaf in leaves if len(leaf.shape)}
    return f"{'/'.join(str(r) for r in sorted(rows))} rows"


def _nothing_fits(model, predicted, budget):
    needs = [c for c in predicted if c.bytes_per_device is not None]
    smallest = min(needs, key=lambda c: c.bytes_per_device, default=None)
    largest = max(model.variables, key=lambda v: _variable_bytes(v), default=None)
    need = (
        f"the smallest need is {format_bytes(smallest.bytes_per_device)} per "
        f"device ({smallest.name})"
        if smallest is not None
        else "no candidate can run this model"
    )
    variable = (
        f"; its largest variable is {largest.path} "
        f"({format_bytes(_variable_bytes(largest))})"
        if largest is not None
        else ""
    )
    return ValueError(
        f"No candidate distribution fits model {model.name!r} in "
        f"{format_bytes(budget)} per device. Received: {need}{variable}; give "
        "more memory (Auto(device_memory=...), less headroom), more devices, "
        "or a smaller batch. Nothing was moved; the model is unchanged."
    )


def _variable_bytes(variable):
    import numpy as np

    from keras_parallel.plan.sharding_plan import _dtype_name, _numpy_dtype

    count = int(np.prod(variable.shape)) if len(variable.shape) else 1
    return count * np.dtype(_numpy_dtype(_dtype_name(variable))).itemsize
