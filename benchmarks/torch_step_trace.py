"""Traces one torch training step: where it crosses between Keras and keras_parallel.

Issue 34 measures the seam by one step of `fit` on rank 0 of 2: how often the
step passes from Keras's code to keras_parallel's and back, and which
keras_parallel modules it visits. Two counts are printed: every call from
one side into the other (Keras's small helpers such as `tree.flatten` and a
variable's `value` included), and the crossings of control (keras_parallel
calling Keras's step, forward pass or metrics, and those calling back).

Each is counted twice: for the bare step (`model.train_step(batch)` inside
the run's scope), and for one whole step *inside `fit`*, from one batch's
begin to the next's: the epoch iterator's next batch, Keras's step
function, and every callback hook (keras_parallel's exact backups and
preemption agreement included, as `fit` runs them by default).

    KERAS_BACKEND=torch python benchmarks/torch_step_trace.py
"""

import sys

from keras_parallel.keras_seam.model_state import binding_of

#: Keras's functions of control in a step; any other is a helper.
_CONTROL = {
    "train_step",
    "call",
    "__call__",
    "compute_loss",
    "compute_metrics",
    "get_metrics_result",
    "apply",
    "apply_gradients",
    "_call",
    "forward",
}


def _tracer():
    """`(profile function, events, {visited module: its functions})` for `sys.setprofile`."""
    events = []
    visited = {}

    def side(frame):
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("keras_parallel"):
                return "keras_parallel", module, frame.f_code.co_name
            if module.startswith("keras"):
                return "keras", module, frame.f_code.co_name
            frame = frame.f_back
        return None, "", ""

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = side(frame)
        caller = side(frame.f_back)
        if callee[0] == "keras_parallel":
            visited.setdefault(callee[1], set()).add(callee[2])
        if callee[0] and caller[0] and callee[0] != caller[0]:
            events.append((caller, callee))

    return profile, events, visited


def _model():
    import keras

    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = Net(inputs, keras.layers.Dense(4)(hidden))
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    return model


def _trace_steps():
    """`{"bare step": (events, modules), "step inside fit": (events, modules)}`."""
    import keras
    import numpy as np
    import torch

    from keras_parallel.run.run import Run

    model = _model()
    rows = np.random.default_rng(0)  # The same data on every rank.
    x = rows.random((256, 8), "float32")
    y = rows.random((256, 4), "float32")
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # DDP and steps made.

    profile, events, visited = _tracer()

    class OneStep(keras.callbacks.Callback):
        # From batch 1's begin to batch 2's: one whole step of the loop.
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                sys.setprofile(profile)
            elif batch == 2:
                sys.setprofile(None)

    try:
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[OneStep()])
    finally:
        sys.setprofile(None)
    in_fit = (events, _named(visited))

    profile, events, visited = _tracer()
    batch = (torch.as_tensor(x[:64]), torch.as_tensor(y[:64]))
    with Run(binding_of(model), model):
        step = model.train_step  # The distributed step, installed in scope.
        sys.setprofile(profile)
        try:
            step(batch)
        finally:
            sys.setprofile(None)
    traced = {"bare step": (events, _named(visited)), "step inside fit": in_fit}
    return traced


def _named(visited):
    """`[(module, "its functions called, sorted")]`, by module."""
    return [(m, ", ".join(sorted(f))) for m, f in sorted(visited.items())]


def _is_control(caller, callee):
    # Keras's `__setattr__` hook reaching a model's own is bookkeeping.
    if callee[2] == "__setattr__":
        return False
    return caller[2] in _CONTROL or callee[2] in _CONTROL


def main():
    from keras_parallel.launcher.torch_processes import launch

    traced = launch(_trace_steps, 2, timeout=180)[0]
    for what, (events, modules) in traced.items():
        control = [(a, b) for a, b in events if _is_control(a, b)]
        print(f"{what}:")
        print(f"  calls across the boundary, helpers included: {len(events)}")
        print(f"  crossings of control: {len(control)}")
        for (_, caller_module, caller), (_, module, function) in control:
            print(f"    {caller_module}.{caller} -> {module}.{function}")
        print(f"  keras_parallel modules visited: {len(modules)}")
        for module, functions in modules:
            print(f"    {module}: {functions}")


if __name__ == "__main__":
    main()
