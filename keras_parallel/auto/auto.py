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
candidate's plan says, and the bytes its collectives move per step. The
candidates and the choice among them are `auto/choice.py`'s; this module is
what the user gives: `Auto`, its budget and sizes.
"""

import re

from keras_parallel.errors import ShardingError

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
        #: The `auto_choice.Choice` made, once made.
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
                "and these devices report none (a CPU, or TensorFlow's). "
                "Received: "
                "Auto(device_memory=None); pass the bytes each device may "
                'use, e.g. keras_parallel.Auto(device_memory="2GiB").'
            )
        return int(memory * (1 - self.headroom))


def check_backend(executor_class):
    """Refuses `Auto` on a backend that cannot predict a step's memory.

    Raises:
        ShardingError: naming the backend and what to pass instead.
    """
    if executor_class.auto_support is None:
        raise ShardingError(
            "Auto chooses a distribution from the memory a step will take, "
            "which keras_parallel does not predict on this backend. Received: "
            f"distribution=Auto() on the {executor_class.backend} backend; "
            "pass keras_parallel.DataParallel() (or shard=, ModelParallel) "
            "yourself."
        )


def as_auto(distribution):
    """`Auto()` for the string `"auto"`; anything else unchanged."""
    if isinstance(distribution, str) and distribution.lower() == "auto":
        return Auto()
    return distribution
