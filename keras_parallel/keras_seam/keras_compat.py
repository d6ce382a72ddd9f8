"""The Keras internals keras_parallel relies on, and the Keras versions it runs on.

keras_parallel reuses Keras's trainer, so it uses private Keras names that move
between releases. Other modules get them only from here or from
`backends/<name>/keras_compat.py`; a Keras lacking one fails at import.
"""

import importlib

from keras_parallel.errors import UnsupportedKerasError
from keras_parallel.keras_seam.replacement_targets import Target

#: The Keras releases keras_parallel supports (as in `pyproject.toml`).
SUPPORTED_KERAS = ">=3.15"
MINIMUM_KERAS = (3, 15)
#: The Keras versions the test matrix runs (`tox.ini`).
CHECKED_KERAS = ("3.15.0", "3.15.1", "3.16.0.dev2026102704")


def keras_version():
    """The installed Keras version, e.g. `"3.15.1"`."""
    import keras

    return keras.version()


def internal(module_name, *names):
    """Imports a Keras module after checking that it has every name we use.

    Args:
        module_name: e.g. `"keras.src.backend.jax.trainer"`.
        *names: attribute names, dotted for nested ones
            (`"TFEpochIterator._get_iterator"`).

    Returns:
        The module.

    Raises:
        UnsupportedKerasError: the module or one of the names is missing.
    """
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise _unsupported(module_name) from error
    for name in names:
        find(module, name, module_name)
    return module


def require_keras(minimum):
    """Refuses a Keras older than `minimum`, e.g. `(3, 15)`, with
    `UnsupportedKerasError`; a development build counts as its release."""
    found = tuple(int(p) for p in keras_version().split(".")[:2])
    if found < tuple(minimum):
        raise _unsupported(f"Keras >= {'.'.join(map(str, minimum))}")


def internal_any(module_name, *names):
    """The first of `names` that a Keras module has (a renamed internal).

    Args:
        module_name: the module.
        *names: the name in each Keras version, newest last.

    Returns:
        The attribute's value.

    Raises:
        UnsupportedKerasError: the module has none of the names.
    """
    module = internal(module_name)
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise _unsupported(f"{module_name}.{' or '.join(names)}")


def find(owner, dotted, where=None):
    """`owner.a.b` for `dotted="a.b"`, or `UnsupportedKerasError` naming it."""
    value = owner
    for part in dotted.split("."):
        if not hasattr(value, part):
            raise _unsupported(f"{where or owner!r}.{dotted}")
        value = getattr(value, part)
    return value


def _unsupported(what):
    return UnsupportedKerasError(
        f"keras_parallel needs `{what}` (a Keras internal or release), which "
        f"the installed Keras does not have. Received: keras=={keras_version()}; "
        f"keras_parallel supports keras{SUPPORTED_KERAS} (checked with "
        f"{', '.join(CHECKED_KERAS)}). Install one of those, e.g. "
        "`pip install keras==3.15.1`."
    )


# No one internal shows the floor. Up to 3.14, JAX `train_on_batch` under a
# distribution fails on `sample_weight=None`, and TensorFlow's `DataParallel`
# calls a `num_processes` its distribution_lib lacks; 3.11's JAX trainer
# records the variables' shardings before they are laid out.
require_keras(MINIMUM_KERAS)

#: The base of every distribution (`keras.distribution` exports only subclasses).
Distribution = internal(
    "keras.src.distribution.distribution_lib", "Distribution"
).Distribution
#: Keras's progress printing (respects `keras.config.disable_interactive_logging`).
print_msg = internal("keras.src.utils.io_utils", "print_msg").print_msg

#: Runs a function on symbolic tensors: the layers' call order (`logical_axes`).
compute_output_spec = internal(
    "keras.src.backend", "compute_output_spec"
).compute_output_spec

#: Keras's global state: its innermost name scope's `caller` is the layer
#: making a variable (`ModelParallel(rules=...)`, `distribution.py`).
global_state = internal("keras.src.backend.common.global_state", "get_global_attribute")


def layer_making_variable():
    """The layer whose `add_weight` runs now, or `None`."""
    stack = global_state.get_global_attribute("name_scope_stack", default=None)
    caller = getattr(stack[-1], "caller", None) if stack else None
    return caller if isinstance(caller, _keras_layer()) else None


def _keras_layer():
    import keras

    return keras.layers.Layer


#: Names a class in a saved config; wrapped by `DistributedModel.save`.
serialization_lib = internal(
    "keras.src.saving.serialization_lib", "serialize_with_public_class"
)
#: A functional DistributedModel is saved as one, for plain Keras to load.
Functional = internal("keras.src.models.functional", "Functional").Functional

#: Keras's epoch iterator: its data adapter (3.16) seeds shuffles by `_epoch`,
#: which a resumed run sets (`persistence/backup.py`).
EpochIterator = internal(
    "keras.src.trainers.epoch_iterator", "EpochIterator"
).EpochIterator

#: What keras_parallel replaces on every backend (`replacements`).
REPLACED = (
    Target(
        "keras.src.callbacks.backup_and_restore.BackupAndRestore",
        ("_save_model", "_load_model", "on_epoch_begin", "on_train_end"),
        "backups written whole, with the random state; resumed exactly; "
        "deleted at the end by process 0 alone (`persistence/backup.py`)",
    ),
    Target(
        "keras.src.callbacks.callback_list.CallbackList",
        (
            "on_train_batch_end",
            "on_epoch_end",
            "set_params",
            "on_epoch_begin",
            "on_train_batch_begin",
            "on_test_batch_begin",
            "on_test_batch_end",
            "on_predict_batch_begin",
            "on_predict_batch_end",
        ),
        "after every training batch, whether the processes agreed to stop "
        "for a preemption signal (through their runtime's key-value store, "
        "`persistence/stop_agreement.py`), and the stop there with a backup "
        "(`persistence/preemption.py`); every epoch's and batch's begin and "
        "end counted, this process's position for the stall watch "
        "(`run/stall_watch_part.py`); each run's list, once made, edited: "
        "writers out on processes other than 0 (`run/chief.py`), keras_parallel's "
        "own callbacks in (`keras_seam/callback_lists.py`)",
    ),
    Target(
        "keras.src.trainers.epoch_iterator.EpochIterator",
        "_enumerate_iterator",
        "the first enumerated after a backup is looked for is the training "
        "iterator: its data adapter a resumed run moves on, and it passes over "
        "the batches a mid-epoch backup had trained (`persistence/backup.py`)",
    ),
    Target(
        "keras.src.saving.serialization_lib",
        "serialize_with_public_class",
        "a DistributedModel saved as Keras's own class (`persistence/saving.py`)",
    ),
    Target(
        "keras.src.models.model.Model",
        ("save", "save_weights", "_symbolic_build"),
        "methods put on the model itself while a part is in force "
        "(`keras_seam/overrides.py`; its class is never changed): `save` and "
        "`save_weights` writing whole files (`persistence/atomic.py`), "
        "nothing on processes other than 0 (`run/chief.py`), the split variables "
        "gathered first under torch ModelParallel "
        "(`backends/torch/model_parallel.py`); the batch Keras builds the "
        "model from seen, for `Auto` (`keras_seam/first_batch.py`)",
        on_instances=True,
    ),
)

#: Attributes of Keras objects that keras_parallel reads or sets, by owner.
OBJECT_ATTRIBUTES = {
    # Model._flatten_layers walks nested layers (TF executor, sync BN);
    # _symbolic_build builds a model from a batch: called first for the
    # `*_on_batch` calls (`Executor.build_from_batch`), and overridden to see
    # the batch Auto chooses for (`keras_seam/first_batch.py`).
    "keras.Model": ("_flatten_layers", "_symbolic_build"),
    # The LayoutMap of a ModelParallel (plan, executors' checks, saving).
    "keras.distribution.ModelParallel": ("_layout_map",),
    # Keras's record of where a run is, read and set by the exact backup.
    "keras.callbacks.BackupAndRestore": (
        "_training_metadata_path",
        "_prev_training_metadata_path",
        "_weights_path",
        "_current_epoch",
        "_last_batch_seen",
        "_batches_seen_since_last_saving",
        "_save_model",
    ),
    # The input kinds (`input/kinds.py`, every backend's `divided_input`).
    "TFDatasetAdapter": ("_dataset",),
    "PyDatasetAdapter (its tf.data signature made)": ("_output_signature",),
}

#: Attributes of Keras objects that only exist in some versions or states,
#: read with a default where missing; listed, not checked on objects.
UNCHECKED_ATTRIBUTES = {
    # Keras 3.16: a shuffle's epoch (set on resume), a PyDataset's processes.
    "data adapters (Keras 3.16)": ("_epoch", "_num_data_shards"),
    # Set on a resumed run, read by `fit`: the exact backup sets it as Keras's.
    "keras.Model (resumed)": ("_initial_epoch",),
}

#: Private names of Python's own objects keras_parallel uses.
OTHER_PRIVATE_NAMES = {
    # A process that must end without running `atexit` (a failed rank).
    "os": ("_exit",),
    # The caller's frame (torch's `same_data`: who started an epoch); every
    # thread's stack (a stalled process's report: `run/stall_watch.py`).
    "sys": ("_getframe", "_current_frames"),
    # Whether a module is still being imported (`keras_parallel/__init__`).
    "module.__spec__": ("_initializing",),
    # A `multiprocessing.SimpleQueue` polled with a timeout (`launch`).
    "multiprocessing.SimpleQueue": ("_reader",),
}
