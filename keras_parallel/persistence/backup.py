"""`keras.callbacks.BackupAndRestore`, made atomic and exact.

Keras's callback writes its files in place and leaves the random state out.
While an entry point runs, `ExactBackups` replaces its `_save_model` and
`_load_model`: the weights go to a new file that the renamed metadata names,
the metadata keeps the random state, and a mid-epoch backup records the batches
trained, which the resumed run passes over (docs/checkpoints.md).
"""

import json
import os
import weakref

import numpy as np
from keras import callbacks

from keras_parallel.keras_seam.keras_compat import EpochIterator
from keras_parallel.keras_seam.replacements import Replacements
from keras_parallel.persistence import atomic, backup_checks
from keras_parallel.persistence.backup_checks import BackupError
from keras_parallel.persistence.backup_random_state import (
    random_state,
    set_random_state,
)

#: The key of keras_parallel's part of `training_metadata.json`.
METADATA_KEY = "keras_parallel"
_WEIGHTS_PREFIX = "weights-"
_WEIGHTS_SUFFIX = ".weights.h5"


class ExactBackups:
    """Installs the atomic, exact `BackupAndRestore` while an entry point runs.

    Args:
        executor: the binding's executor (its host random state).
    """

    def __init__(self, executor):
        self.executor = executor
        self._replacements = Replacements()

    def install(self):
        executor = self.executor
        patches = {
            (callbacks.BackupAndRestore, "_save_model"): lambda cb: _save(cb, executor),
            (callbacks.BackupAndRestore, "_load_model"): lambda cb: _load(cb, executor),
            (
                callbacks.BackupAndRestore,
                "on_epoch_begin",
            ): lambda cb, epoch, logs=None: _epoch_begins(cb, epoch, executor),
            (EpochIterator, "_enumerate_iterator"): _resumed_enumerate(
                EpochIterator._enumerate_iterator
            ),
        }
        if not executor.is_chief:
            # Keras deletes the backup when training ends: rank 0 alone.
            patches[(callbacks.BackupAndRestore, "on_train_end")] = (
                lambda *args, **kwargs: None
            )
        for (cls, name), function in patches.items():
            self._replacements.replace(cls, name, function)

    def uninstall(self):
        self._replacements.restore()


#: The `BackupAndRestore` that loaded (or looked for) its backup last, whose
#: training iterator is not known yet (a weak reference). `fit` makes its
#: training iterator before `on_train_begin`, where the backup is loaded,
#: and enumerates it first after: the next iterator enumerated is it. Found
#: there, not where it is made, so that both doors find it (a
#: `ShardingCallback` is handed the model after the iterator is made).
_awaiting_iterator = [None]


class BackupProgress:
    """Where a `BackupAndRestore`'s run is, beyond Keras's own record
    (`callback._kp_backup`, set past Keras's tracking).

    Attributes:
        epoch: the epoch begun last, or None before the first.
        epoch_state: the random state that epoch began from.
        training_iterator: a weak reference to the run's training iterator.
        counted_adapter: a weak reference to the data adapter whose epoch
            count was moved on for a resumed run.
        steps_to_skip: the batches a mid-epoch backup had trained, passed
            over once the training iterator starts.
    """

    def __init__(self):
        self.epoch = None
        self.epoch_state = None
        self.training_iterator = None
        self.counted_adapter = None
        self.steps_to_skip = 0


def progress_of(callback):
    """`callback`'s `BackupProgress`, made on first use."""
    progress = vars(callback).get("_kp_backup")
    if progress is None:
        progress = BackupProgress()
        object.__setattr__(callback, "_kp_backup", progress)
    return progress


def _epoch_begins(callback, epoch, executor):
    # The state a resumed run must start this epoch from, for saves made
    # before it ends.
    progress = progress_of(callback)
    progress.epoch = epoch
    progress.epoch_state = random_state(callback.model, executor)
    _count_resumed_epochs(callback)


def _count_resumed_epochs(callback):
    progress = progress_of(callback)
    reference = progress.training_iterator
    adapter = getattr(reference and reference(), "data_adapter", None)
    counted = progress.counted_adapter
    if isinstance(getattr(adapter, "_epoch", None), int) and (
        counted is None or counted() is not adapter
    ):
        # keras-nightly shuffles by the adapter's count of the epochs this
        # `fit` ran: a run resumed at epoch k counts as if it had run k.
        progress.counted_adapter = weakref.ref(adapter)
        adapter._epoch += progress.epoch or 0


def _resumed_enumerate(keras_enumerate):
    """Keras's `EpochIterator._enumerate_iterator`, first passing over the
    batches a mid-epoch backup had trained (`BackupProgress.steps_to_skip`,
    set when the backup is loaded)."""

    def enumerate_resumed(iterator):
        reference, _awaiting_iterator[0] = _awaiting_iterator[0], None
        callback = reference and reference()
        skip = 0
        if callback is not None:
            progress = progress_of(callback)
            progress.training_iterator = weakref.ref(iterator)
            _count_resumed_epochs(callback)
            skip, progress.steps_to_skip = progress.steps_to_skip, 0
        passed = 0
        for item in keras_enumerate(iterator):
            begin_step, _, data = item
            if begin_step >= skip:
                yield item
                continue
            try:
                next(data)  # Drawn as the interrupted run drew it; not trained.
                passed += 1
            except StopIteration:
                break
        if passed < skip:
            raise BackupError(
                f"the backup was made after {skip} batches of its epoch, and "
                f"this run's data has only {passed} in an epoch. Received: "
                "other data or batch size than the run that wrote the backup; "
                "resume with the same data and batch size, or delete the "
                "backup folder to start afresh."
            )

    return enumerate_resumed


def _save(callback, executor):
    directory = callback.backup_dir
    # Readable by its user only; one made by another user is refused.
    os.makedirs(directory, mode=0o700, exist_ok=True)
    backup_checks.check_owner(directory)
    previous = _read_metadata(callback._training_metadata_path)
    number = previous.get(METADATA_KEY, {}).get("generation", 0) + 1 if previous else 1
    weights_name = f"{_WEIGHTS_PREFIX}{number}{_WEIGHTS_SUFFIX}"
    # Not referenced by any metadata yet: a kill half way leaves an orphan.
    callback.model.save_weights(os.path.join(directory, weights_name), overwrite=True)
    epoch = callback._current_epoch
    state = random_state(callback.model, executor)
    steps_done = 0
    progress = progress_of(callback)
    if progress.epoch is not None and progress.epoch >= epoch:
        # Saved within an epoch (integer `save_freq`, a preemption). Keras's
        # `_current_epoch` moves at epoch ends only, 0 in a resumed run's first epoch.
        epoch = progress.epoch
        batches = (callback.params or {}).get("steps")
        last_batch = batches and callback._last_batch_seen + 1 >= batches
        if callback.model.steps_per_execution == 1 and not last_batch:
            # Resumed after the trained batches: the epoch's shuffle from its
            # first host random state, the dropout masks from here on.
            steps_done = callback._last_batch_seen + 1
            state = dict(progress.epoch_state, seed_generators=state["seed_generators"])
        else:
            # Resumed at the epoch's start (after its last batch it would train
            # none; a preemption there waits for the epoch's end: preemption.py).
            state = progress.epoch_state
    metadata = {
        "epoch": epoch,
        "batch": callback._last_batch_seen,
        METADATA_KEY: {
            "generation": number,
            "weights": weights_name,
            "random_state": state,
            "steps_done": steps_done,
            "topology": _topology(executor),
            # Another batch size (or data) would resume at another row.
            "batches_per_epoch": (callback.params or {}).get("steps"),
        },
    }
    if not executor.is_chief:
        return  # Its part of a collective save is done; rank 0 writes.
    keep = {weights_name}
    if callback.double_checkpoint and previous:
        atomic.write_text(callback._prev_training_metadata_path, json.dumps(previous))
        keep.add(previous.get(METADATA_KEY, {}).get("weights"))
    atomic.write_text(callback._training_metadata_path, json.dumps(metadata))
    for name in os.listdir(directory):
        if _is_weights_file(name) and name not in keep:
            os.remove(os.path.join(directory, name))


def _load(callback, executor):
    model = callback.model
    if not model.built:
        raise ValueError(
            "To use the BackupAndRestore callback, your model must be built "
            f"before you call `fit()`. Received: model {model.name!r}, unbuilt; "
            "build it first (call it on a batch of data, or `model.build`)."
        )
    progress_of(callback).training_iterator = None
    _awaiting_iterator[0] = weakref.ref(callback)
    if os.path.isdir(callback.backup_dir):
        backup_checks.check_owner(callback.backup_dir)
    metadata = _read_metadata(callback._training_metadata_path)
    if metadata is None:
        return  # No backup: a fresh start.
    try:
        _restore(callback, metadata, executor)
    except BackupError:
        fallback = _read_metadata(callback._prev_training_metadata_path)
        if not callback.double_checkpoint or fallback is None:
            raise
        _restore(callback, fallback, executor)


def _restore(callback, metadata, executor):
    model = callback.model
    ours = metadata.get(METADATA_KEY)
    if ours:
        backup_checks.check_batches_per_epoch(callback, ours)  # Before any load.
        name = backup_checks.weights_name(ours, callback.backup_dir)
    else:
        name = os.path.basename(callback._weights_path)
    weights = os.path.join(callback.backup_dir, name)
    if os.path.exists(weights):
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        try:
            model.load_weights(weights)
        except Exception as error:  # noqa: BLE001 - h5py, Keras: many types.
            raise BackupError(
                f"the backup {weights!r} cannot be loaded into model "
                f"{model.name!r}: it was written by another model, or the "
                "file is damaged; delete the backup folder "
                f"{callback.backup_dir!r} to start afresh, or train the model "
                f"that wrote it. The load failed with: {_root_cause(error)}"
            ) from error
    if ours:
        set_random_state(model, executor, ours["random_state"])
        steps_done = ours.get("steps_done", 0)
        if steps_done:
            # Passed over by the training iterator (`_resumed_enumerate`).
            progress_of(callback).steps_to_skip = steps_done
            # Keras counts batches since its last save from here.
            callback._last_batch_seen = steps_done - 1
            callback._batches_seen_since_last_saving = 0
    model._initial_epoch = metadata["epoch"]
    if executor.is_chief:
        print(resumed_line(metadata, executor), flush=True)


def _topology(executor):
    """The devices and processes a run trains on, as a backup records them."""
    mesh = getattr(executor.distribution, "device_mesh", None)
    devices = 1 if mesh is None else int(np.prod(mesh.shape))
    return {"devices": devices, "processes": executor.num_processes}


def _described(topology):
    devices, processes = topology["devices"], topology["processes"]
    return (
        f"{devices} device{'s' * (devices != 1)} in {processes} "
        f"process{'es' * (processes != 1)}"
    )


def resumed_line(metadata, executor):
    """What a resumed run prints: where it resumed, from what, on what.

    A backup resumes on another number of devices or processes (the same
    global batch, split otherwise): the line says both.

    Args:
        metadata: the backup's `training_metadata.json`, read.
        executor: the run's executor (its devices now).

    Returns:
        A line such as "keras_parallel: resumed in epoch 3 after 4 batches,
        from a backup made on 8 devices in 1 process; now 4 devices in 1
        process".
    """
    ours = metadata.get(METADATA_KEY) or {}
    steps_done = ours.get("steps_done", 0)
    where = f"in epoch {metadata['epoch'] + 1}"
    if steps_done:
        where += f" after {steps_done} batch{'es' * (steps_done != 1)}"
    made = ours.get("topology")
    made = _described(made) if made else "a topology it does not record"
    now = _described(_topology(executor))
    return f"keras_parallel: resumed {where}, from a backup made on {made}; now {now}"


def _read_metadata(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError as error:
        raise BackupError(
            f"the backup metadata {path!r} is not JSON ({error}). Received: "
            f"{text[:80]!r}; delete the backup folder to start afresh."
        ) from None


def _root_cause(error):
    """The first error of `error`'s chain, as `Type: message`: the backup's
    message names the file and the fix itself, so it quotes only the cause
    (a `DistributedModel`'s `load_weights` wraps Keras's error in its own)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"


def _is_weights_file(name):
    return name.startswith(_WEIGHTS_PREFIX) and name.endswith(_WEIGHTS_SUFFIX)
