"""`Auto`: the distribution chosen for the model, the devices and the batch.

Given a memory budget per device, `Auto` lists the candidate distributions in
order of the communication they cost, predicts each one's memory per device
before any step runs, and chooses the first that fits:

1. `DataParallel()`: every device holds everything, one all-reduce of the
   gradients per step;
2. `DataParallel(shard="optimizer")`: the optimizer state split (ZeRO-1/2);
3. `DataParallel(shard="full")`: variables, gradients and optimizer state
   split, each variable gathered where it is used (FSDP, ZeRO-3);
4. `ModelParallel(rules="auto")` over a `(data, model)` mesh of each
   factorization of the devices, the model axis growing (2, 4, ...);
5. the same with `shard="full"`.

The prediction is the backend's (`Executor.step_memory`): on JAX, the
compiled train step's own memory analysis (XLA's, on CPU too) for the global
batch, with the variables, gradients and optimizer slots laid out as the
candidate's plan says, and the bytes its collectives move per step.
"""

import dataclasses
import re

from keras_parallel.errors import ShardingError
from keras_parallel.report import format_bytes

#: Headroom kept free by default: a tenth of the device's memory.
DEFAULT_HEADROOM = 0.1

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value, name="device_memory"):
    """A number of bytes from an int or a string such as `"2GiB"` or `"100MB"`.

    MB, GB are powers of 10 (10^6, 10^9), MiB, GiB powers of 2 (2^20, 2^30).

    Args:
        value: an int (bytes), or a string: a number and a unit.
        name: the argument's name, for the error.

    Returns:
        The bytes, an int.

    Raises:
        ValueError: `value` is not a positive size.
    """
    if isinstance(value, bool):
        value = None
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            size = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if size >= 1:
                return int(size)
    raise ValueError(
        f"`{name}` must be a positive size in bytes. Received: {name}={value!r}; "
        'pass an int of bytes or a string such as "2GiB" (2^30 bytes) or '
        '"100MB" (10^6 bytes).'
    )


class Auto:
    """Chooses the distribution from the memory each candidate will take.

    Accepted wherever a distribution is: `compile(..., distribution=Auto())`
    of a `DistributedModel`, `ShardingCallback(Auto())`; the string `"auto"`
    means `Auto()`. The choice is made at the first `fit` (or `evaluate`,
    `train_on_batch`, `test_on_batch`), when the model, its optimizer and
    the batch are known, before any step; `describe(model)` and that `fit`
    print the candidates' table.

    Args:
        device_memory: the bytes each device may use: an int, or a string
            such as `"2GiB"` or `"100MB"`. `None` (the default): what the
            device reports (JAX's `memory_stats()` on a GPU or TPU); a CPU
            reports none, and then it is required.
        headroom: the fraction of `device_memory` kept free (for what the
            prediction does not see: the input pipeline, fragmentation).
            Default 0.1.

    Raises:
        ValueError: `device_memory` is not a size, or `headroom` is not in
            [0, 1).

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse",
                  distribution=keras_parallel.Auto(device_memory="16GiB"))
    model.fit(x, y, batch_size=256)  # prints the candidates, then trains
    ```
    """

    def __init__(self, device_memory=None, headroom=DEFAULT_HEADROOM):
        self.device_memory = (
            None if device_memory is None else parse_bytes(device_memory)
        )
        if isinstance(headroom, bool) or not (
            isinstance(headroom, (int, float)) and 0 <= headroom < 1
        ):
            raise ValueError(
                "`headroom` is the fraction of the device's memory kept free. "
                f"Received: headroom={headroom!r}; pass a number in [0, 1), "
                "such as 0.1."
            )
        self.headroom = float(headroom)
        #: The `Choice` made, once made.
        self.choice = None

    def __repr__(self):
        memory = "None" if self.device_memory is None else self.device_memory
        return f"Auto(device_memory={memory}, headroom={self.headroom})"

    def budget(self, executor_class):
        """The bytes per device a candidate may take (memory less headroom).

        Raises:
            ValueError: no `device_memory` was given and the device reports
                none (a CPU).
        """
        memory = self.device_memory
        if memory is None:
            memory = executor_class.device_memory()
        if memory is None:
            raise ValueError(
                "Auto needs the memory of a device to choose a distribution, "
                "and these devices report none (a CPU). Received: "
                "Auto(device_memory=None); pass the bytes each device may "
                'use, e.g. keras_parallel.Auto(device_memory="2GiB").'
            )
        return int(memory * (1 - self.headroom))


def check_backend(executor_class):
    """Refuses `Auto` on a backend that cannot predict a step's memory yet.

    Raises:
        ShardingError: naming the backend and what to pass instead.
    """
    if not executor_class.auto_candidate_kinds:
        raise ShardingError(
            "Auto chooses a distribution from the compiled step's memory, "
            "which keras_parallel predicts on JAX only for now. Received: "
            f"distribution=Auto() on the {executor_class.backend} backend; "
            "pass keras_parallel.DataParallel() (or shard=, ModelParallel) "
            "yourself, or use the JAX backend."
        )


def as_auto(distribution):
    """`Auto()` for the string `"auto"`; anything else unchanged."""
    if isinstance(distribution, str) and distribution.lower() == "auto":
        return Auto()
    return distribution


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
            ]
        )


def candidates(executor_class, devices):
    """`[(name, distribution)]` of `Auto`'s candidates over `devices`.

    Args:
        executor_class: the backend's executor class
            (`Executor.auto_candidate_kinds` limits which kinds it runs).
        devices: the device names every candidate spans.
    """
    import keras

    from keras_parallel.distribution import DataParallel, ModelParallel

    kinds = executor_class.auto_candidate_kinds
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
    return Choice(tuple(predicted), chosen, budget, _batch_text(batch), seconds)


def first_fitting(predicted, budget):
    """The first `Candidate` of `predicted` that fits `budget`, or None."""
    return next((c for c in predicted if c.fits(budget)), None)


def _first_line(error):
    return str(error).split(". ")[0].split("\n")[0][:80]


def _batch_text(batch):
    import keras

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

    from keras_parallel.plan import _dtype_name, _numpy_dtype

    count = int(np.prod(variable.shape)) if len(variable.shape) else 1
    return count * np.dtype(_numpy_dtype(_dtype_name(variable))).itemsize
