"""Files that a reader sees whole or not at all.

A file is written under a temporary name in its own folder, flushed to disk,
then renamed over its final name: a rename within one file system is atomic,
so a process killed while writing leaves the previous file (or none), never
half of one.

The temporary file is made by `tempfile.mkstemp` (a name nobody can guess,
created by this process, readable by its user only): in a folder others
can write to (a shared `/tmp`), a name known in advance could be a
symbolic link placed there to send the write elsewhere.
"""

import contextlib
import os
import tempfile

from keras_parallel.keras_seam.overrides import Overrides, override


@contextlib.contextmanager
def replacing(path):
    """Yields a temporary path to write; renames it to `path` on success.

    Remote paths (`gs://...`) are written in place: their file systems
    have no rename to rely on.

    Args:
        path: the final file name. Its suffix is kept (Keras checks it).

    Example:

    >>> with replacing("model.keras") as temporary:
    ...     model.save(temporary)
    """
    path = os.fspath(path)
    if "://" in path:
        yield path
        return
    folder, name = os.path.split(os.path.abspath(path))
    # The name ends as `path` does: Keras checks the suffix.
    handle, temporary = tempfile.mkstemp(
        prefix=f".{name}.", suffix=f".partial.{name}", dir=folder
    )
    os.close(handle)
    try:
        yield temporary
        # Still empty: nothing was written (a process whose part of a
        # collective save writes no file), so nothing is replaced.
        if os.path.isfile(temporary) and os.path.getsize(temporary):
            with open(temporary, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.remove(temporary)


def write_text(path, text):
    """Writes `text` to `path` atomically (see module docstring)."""
    # Closed, then flushed to disk by `replacing` before the rename.
    with replacing(path) as temporary, open(temporary, "w") as f:
        f.write(text)


def file_argument(args, kwargs):
    """`(args, kwargs)` of `save(filepath, ...)` with `filepath` taken out.

    Returns:
        `(filepath, rebuild)`: `rebuild(path)` gives the arguments with
        `path` in its place. `filepath` is None when there is none.
    """
    if args:
        return args[0], lambda path: ((path, *args[1:]), kwargs)
    if "filepath" in kwargs:
        return kwargs["filepath"], lambda path: (args, dict(kwargs, filepath=path))
    return None, None


def call_replacing(save, args, kwargs, executor=None, model=None):
    """Calls `save(*args, **kwargs)` so that its file appears whole.

    Args:
        save: `model.save` or `model.save_weights`. With `overwrite=False`
            and an existing file, Keras's own question comes first: no
            temporary.
        args: its positional arguments.
        kwargs: its keyword arguments.
        executor: the model's executor, if it is distributed: its
            `checkpoint_io.saving(model)` is in force while the file is written.
        model: the model `save` saves (with `executor`).

    Returns:
        What `save` returns.
    """
    path, rebuild = file_argument(args, kwargs)
    local = isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path)
    context = (
        contextlib.nullcontext()
        if executor is None
        else executor.checkpoint_io.saving(model)
    )
    with context:
        if not local or (not kwargs.get("overwrite", True) and os.path.exists(path)):
            return save(*args, **kwargs)
        with replacing(path) as temporary:
            new_args, new_kwargs = rebuild(temporary)
            if "overwrite" in new_kwargs:
                # The temporary file exists (empty): Keras must not ask.
                new_kwargs["overwrite"] = True
            return save(*new_args, **new_kwargs)


class AtomicSaving(Overrides):
    """`save` and `save_weights` that write whole files (`call_replacing`).

    Args:
        executor: the executor whose `checkpoint_io.saving` is in force
            meanwhile, or None.
    """

    names = ("save", "save_weights")

    def __init__(self, executor):
        self.executor = executor

    def save(self, *args, **kwargs):
        return call_replacing(
            self.overridden.save, args, kwargs, self.executor, self.model
        )

    def save_weights(self, *args, **kwargs):
        return call_replacing(
            self.overridden.save_weights, args, kwargs, self.executor, self.model
        )


def atomic_saving(model, executor=None):
    """Makes `model.save` and `save_weights` write whole files.

    For models that are not a `DistributedModel` (whose own methods do it),
    while a `ShardingCallback` is attached.

    Returns:
        A function that undoes it.
    """
    return override(model, AtomicSaving(executor))
