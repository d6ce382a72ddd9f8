"""`restore_checkpoint`: an `OrbaxCheckpoint` back into a distributed model.

Keras's `OrbaxCheckpoint` saves a model shard by shard, but
`model.load_weights(directory)` reads each array onto the mesh it was saved
from and skips variables whose path differs (`adam_1`, not `adam`).
`restore_checkpoint` reads each array into the layout of the variable it
restores, and refuses a checkpoint that does not fit the model.
"""

import os


def restore_checkpoint(model, directory, step=None):
    """Restores a `keras.callbacks.OrbaxCheckpoint` into a built model.

    Each array is read from the checkpoint straight into the layout of the
    variable it restores: a `DistributedModel` compiled with a distribution
    gets every shard on the devices its plan names, each device reading only
    its own part, so the whole model is never gathered on one device or
    host. The mesh may differ from the one the checkpoint was saved on
    (saved on `(2, 4)`, restored on `(4, 2)`, `(1, 8)` or one device). Across
    JAX processes, call it on every process: each reads its own devices'
    shards.

    Restored: the model's weights, the optimizer's state (its slots and
    step counter; an unbuilt optimizer is built first) and the metric
    variables both have. The optimizer's own name (`adam` or `adam_1`) need
    not match.

    Args:
        model: a built `keras.Model`, compiled if its optimizer state is to
            be restored.
        directory: the `OrbaxCheckpoint`'s `directory` (its newest step, or
            `step`, is restored), or one step's folder in it.
        step: the step to restore from `directory`. Defaults to the newest.

    Returns:
        The step restored (an int), which `OrbaxCheckpoint` counts in
        batches (`save_freq=N`) or epochs (`save_freq="epoch"`).

    Raises:
        ValueError: there is no such checkpoint, the model is not built, or
            the checkpoint's variables or shapes differ from the model's.
        NotImplementedError: the Keras backend is not JAX.
        ImportError: `orbax-checkpoint` is not installed.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse", distribution=distribution)
    model.fit(x, y, callbacks=[keras.callbacks.OrbaxCheckpoint(
        "/ckpt", save_freq=100)])

    # Later, in a new process, on any mesh:
    model = build_model()  # the same layers
    model.compile(optimizer="adam", loss="mse", distribution=other_mesh)
    keras_parallel.restore_checkpoint(model, "/ckpt")
    model.fit(x, y, ...)  # continues from the restored step
    ```
    """
    from keras_parallel.backends import executor_class

    checkpoint_io = executor_class().checkpoint_io_class
    if not checkpoint_io.restores_checkpoints:
        checkpoint_io.restore_checkpoint(model, directory)  # Raises: says why.
    path, step = checkpoint_path(directory, step)
    checkpoint_io.restore_checkpoint(model, path)
    return step


def checkpoint_path(directory, step=None):
    """The folder of one step of an `OrbaxCheckpoint` directory.

    Args:
        directory: the callback's `directory`, or one step's folder in it.
        step: the step wanted; defaults to the newest one saved.

    Returns:
        `(path, step)`.

    Raises:
        ValueError: `directory` holds no such (finished) step.
    """
    directory = os.fspath(directory)
    if os.path.isdir(os.path.join(directory, "pytree")):
        name = os.path.basename(os.path.normpath(directory))
        if step is not None and name != str(step):
            raise ValueError(
                f"{directory!r} is the checkpoint of one step, not {step}. "
                f"Received: step={step}; pass the folder that holds the steps "
                "instead."
            )
        return directory, int(name) if name.isdigit() else step
    # Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it
    # when every process has finished: a bare number is a finished step.
    steps = sorted(
        int(name)
        for name in (os.listdir(directory) if os.path.isdir(directory) else ())
        if name.isdigit() and os.path.isdir(os.path.join(directory, name, "pytree"))
    )
    if not steps or (step is not None and step not in steps):
        wanted = "any step" if step is None else f"step {step}"
        raise ValueError(
            f"No finished OrbaxCheckpoint of {wanted} in {directory!r}. "
            f"Received: steps {steps}; pass the `directory` given to "
            "keras.callbacks.OrbaxCheckpoint, and a step it saved."
        )
    step = steps[-1] if step is None else step
    return os.path.join(directory, str(step)), step
