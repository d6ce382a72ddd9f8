"""The Keras internals the torch backend reads or patches, in one place.

See `keras_parallel.keras_compat` for why and how these are checked.
Checked against Keras 3.15.0, 3.15.1 and keras-nightly 3.16.0.dev2026102704.
"""

from keras_parallel.keras_compat import internal
from keras_parallel.replacement_targets import Target

#: Keras's torch trainer module. Up to 3.15 its class is `TorchTrainer`;
#: from 3.16 (keras-nightly) it is `Trainer`, wraps the model in its own DDP
#: unless `model.ddp_model` is set (the executor sets it to False), and sums
#: the metric states over ranks in `get_metrics_result` (`steps` reads them
#: through the base trainer's method instead). `None` before 3.16.
_trainer = internal("keras.src.backend.torch.trainer")
torch_trainer_with_ddp = getattr(_trainer, "Trainer", None)
if torch_trainer_with_ddp is not None:
    internal(
        "keras.src.backend.torch.trainer",
        "Trainer.get_metrics_result",
        "Trainer._initialize_ddp",
    )
#: The epoch iterator of Keras's torch `fit`, `evaluate` and `predict`: its
#: `__iter__` (where an epoch starts) is replaced in scope so that the ranks
#: compare the size of the data they are about to iterate (`same_data`).
TorchEpochIterator = internal(
    "keras.src.backend.torch.trainer",
    "TorchEpochIterator.__iter__",
    "TorchEpochIterator._get_iterator",
).TorchEpochIterator
#: Data given as arrays (NumPy, torch, ...): the only adapter whose row count
#: its public sizes tell exactly (a `DataLoader` may drop its last batch).
ArrayDataAdapter = internal(
    "keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter"
).ArrayDataAdapter
#: The data adapters whose batches the ranks share (`shared_batches`): a
#: `PyDataset`'s batches are made by their owner as Keras's adapter makes
#: them (`_standardize_batch`), a generator's drawn on rank 0 through
#: Keras's NumPy iterator.
internal(
    "keras.src.trainers.data_adapters.py_dataset_adapter",
    "PyDatasetAdapter._standardize_batch",
)
internal(
    "keras.src.trainers.data_adapters.generator_data_adapter",
    "GeneratorDataAdapter.get_numpy_iterator",
)
#: Keras's nested-structure utilities (flatten / map_structure).
tree = internal("keras.src.tree", "flatten", "map_structure")
#: Whether a callback overrides a hook (`step_logs.reads_step_logs`).
is_default = internal("keras.src.utils.python_utils", "is_default").is_default
#: Keras's `Model`: its own `train_step` / `test_step` return the metrics'
#: results through `get_metrics_result` (`keras_step`), and the trainer's
#: `_get_metrics_result_or_logs` picks an epoch's logs (`steps`).
KerasModel = internal(
    "keras.src.models.model",
    "Model.train_step",
    "Model.test_step",
    "Model._get_metrics_result_or_logs",
).Model

#: Keras's own DTensor support in its torch backend (keras-nightly 3.16:
#: `keras.src.backend.torch.distribution_lib`, with the Keras mesh's
#: `backend_mesh`, `TensorLayout.backend_layout` and a `Variable` that
#: redistributes assigned values by its `_layout`), used by
#: `dtensor_layouts` where it exists; `None` with Keras 3.15, which has none.
keras_dtensor = getattr(internal("keras.src.backend"), "distribution_lib", None)
if keras_dtensor is not None and not all(
    hasattr(keras_dtensor, name)
    for name in ("distribute_tensor", "_to_backend_mesh", "_to_backend_layout")
):
    keras_dtensor = None  # Some other torch distribution_lib: use torch's API.

#: The module behind `keras.distribution.list_devices()` and
#: `get_device_count()`, which call its `distribution_lib` (the backend's):
#: `None` on torch before Keras 3.16, which `distribution_lib.provide` fills
#: with the two functions (so the JAX-written mesh script runs on torch).
keras_distribution = internal(
    "keras.src.distribution.distribution_lib",
    "distribution_lib",
    "list_devices",
    "get_device_count",
)
#: The device Keras's torch backend computes on (`"cpu"`, `"cuda"`, ...),
#: which Keras 3.16's torch `list_devices` reads, and so does ours on 3.15.
get_device = (
    internal("keras.src.backend.torch.core", "get_device").get_device
    if keras_dtensor is None
    else keras_dtensor.get_device
)

#: Maps a variable to another value while a layer runs (ModelParallel: an
#: `Embedding` looks rows up in its table gathered along them,
#: `output_constraints`; a weight regularizer reads its variable's whole
#: value, `mesh_losses`).
StatelessScope = internal(
    "keras.src.backend.common.stateless_scope", "StatelessScope"
).StatelessScope

#: Keras's torch `Variable`: its `_initialize` (which stores the value a
#: new variable was made with) is replaced inside `distribution.scope()` so
#: that the variable is placed as a DTensor as soon as it exists
#: (`creation.py`). Read from `keras.src.backend`, which names the running
#: backend's class: keras-nightly moved it from `torch/core.py` to
#: `torch/ops/core.py`.
TorchVariable = internal(
    "keras.src.backend", "Variable._initialize", "Variable._initialize_with_initializer"
).Variable

#: Keras's optimizer with gradient accumulation: its `_iterations` counts
#: the micro-steps (its public `iterations` counts the updates), and its
#: `_accumulated_gradients` hold each variable's gradients summed since the
#: last update (`accumulation.py`).
BaseOptimizer = internal(
    "keras.src.optimizers.base_optimizer",
    "BaseOptimizer._backend_apply_gradients",
).BaseOptimizer

#: Attributes of Keras objects the torch backend reads or sets.
OBJECT_ATTRIBUTES = {
    # ModelParallel (`dtensor_layouts`): a variable's value is replaced by a
    # DTensor parameter; `_layout` tells Keras 3.16's `_direct_assign` how
    # to redistribute assigned values. A variable made from a value has no
    # `_shape` until `_initialize` returns: `creation.py` sets it from the
    # value, for the distribution's layout.
    "keras.Variable": ("_value", "_layout", "_shape"),
    # The axes BatchNormalization's batch statistics reduce (`sync_bn`).
    "keras.layers.BatchNormalization": ("_reduction_axes",),
    # Model._flatten_layers walks nested layers (sync BN, ModelParallel);
    # `_track_variables` re-registers a layer's `_torch_params` after its
    # variables' values became DTensors (`dtensor_layouts.retrack`).
    "keras.Model": ("_flatten_layers", "_torch_params", "_track_variables"),
    # The losses a forward pass added (`add_loss`, activity regularizers),
    # their gradients scaled like the outputs' on an uneven batch (`steps`);
    # under ModelParallel made whole and plain after the forward pass
    # (`mesh_steps`).
    "keras.layers.Layer": ("_losses",),
    # Gradient accumulation under DDP (`accumulation.py`): the micro-step
    # counter; the accumulators (`_accumulated_gradients`, which exist only
    # when `gradient_accumulation_steps` is set) are all-reduced once per
    # update.
    "keras.optimizers.Optimizer": ("_iterations", "gradient_accumulation_steps"),
    # A PyDataset's adapter (`shared_batches`): the dataset and whether the
    # epoch's order is shuffled.
    "PyDatasetAdapter": ("py_dataset", "shuffle"),
}

#: Attributes of Keras objects that exist only in some states; listed, not
#: checked on objects.
UNCHECKED_ATTRIBUTES = {
    # The accumulators, made only when `gradient_accumulation_steps` is set
    # (`accumulation.py`).
    "keras.optimizers.Optimizer (accumulating)": ("_accumulated_gradients",),
}

#: Private names of torch keras_parallel uses.
OTHER_PRIVATE_NAMES = {
    # The process group's store, where a failing rank leaves its name
    # (`group.py`; without it failures are reported unnamed).
    "torch.distributed.distributed_c10d": ("_get_default_store",),
    # A torch module's submodules: where a Keras layer keeps `_torch_params`
    # (`dtensor_layouts.retrack`).
    "torch.nn.Module": ("_modules",),
}

#: What the torch backend replaces while an entry point runs, through
#: `keras_parallel.replacements`.
REPLACED = (
    Target(
        "keras.src.models.model.Model",
        (
            "train_step",
            "test_step",
            "predict_step",
            "get_metrics_result",
            "_get_metrics_result_or_logs",
        ),
        "per-rank steps and global metrics; a custom step's logs made global "
        "(`steps.py`, `step_logs.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.backend.torch.trainer.TorchEpochIterator",
        ("__iter__", "_get_iterator"),
        "every rank compares the size of its data with the others' before an "
        "epoch's first collective (`same_data.py`); each rank loads only its "
        "rows of a map-style loader's global batches (`divided_input.py`)",
    ),
    Target(
        "keras.src.models.model.Model",
        "call",
        "forward pass through DDP (`steps.py`) or on DTensors "
        "(`mesh_steps.py`): replaced for the entry point, routed in train "
        "steps (and, on a mesh, every step)",
        on_instances=True,
    ),
    Target(
        "keras.src.metrics.reduction_metrics.Mean",
        "update_state",
        "in a custom step, one value per step weighted by the rank's share "
        "of the batch (`update_weights.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.layers.layer.Layer",
        "_get_regularization_losses",
        "weight regularizers computed on their variables' whole values: "
        "one device's penalty, a plain scalar for the loss (`mesh_losses.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.backend.common.variables.Variable",
        ("numpy", "assign"),
        "a placed variable's whole value read (gathered, a collective) and "
        "assigned (the same on every process), so that `get_weights()`, "
        "`set_weights()` and `load_weights()` work through either door; for "
        "the model's distributed life (`model_parallel.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.optimizers.optimizer.Optimizer",
        "apply",
        "gradients redistributed to their variables' placements (`mesh_steps.py`); "
        "with gradient accumulation under DDP, the accumulators all-reduced "
        "once before an update (`accumulation.py`); the mean gradient over "
        "the ranks where DDP cannot make it (`gradient_mean.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.backend.Variable",
        "_initialize",
        "inside `distribution.scope()`, each new variable placed as a DTensor "
        "in its layout as soon as it is made, its whole value freed "
        "(`creation.py`)",
    ),
    Target(
        "keras.src.backend.Variable",
        "_initialize_with_initializer",
        "inside `distribution.scope()`, a broken collective while a variable "
        "is placed names the rank that stopped (`creation.py`)",
    ),
    Target(
        "keras.src.layers.layer.Layer",
        "call",
        "layer outputs laid out as planned (`output_constraints.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.layers.attention.multi_head_attention.MultiHeadAttention",
        "_compute_attention",
        "attention on query, key and value split alike (`output_constraints.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.layers.normalization.batch_normalization.BatchNormalization",
        "_moments",
        "global batch statistics (`sync_bn.py`)",
        on_instances=True,
    ),
    Target(
        "keras.src.distribution.distribution_lib",
        "distribution_lib",
        "`keras.distribution.list_devices()` and `get_device_count()` on "
        "torch, as Keras 3.16 has them; set once, where Keras has no torch "
        "`distribution_lib` (`distribution_lib.py`; Keras 3.15)",
    ),
)


def local_metrics_result(model):
    """`model.get_metrics_result`, without Keras 3.16+'s sum over ranks.

    Keras's torch trainer (3.16+) all-reduces the metric states in
    `get_metrics_result` whenever a process group exists. `RankSteps` makes
    them global itself (only when read, a whole-batch tail counted once), so
    Keras's sum would count every row once per rank, and cost an all-reduce
    per metric variable per step. The base trainer's method reads the states
    as they are, as in Keras 3.15. A subclass's own `get_metrics_result` is
    left alone.
    """
    keras_trainer = torch_trainer_with_ddp
    if (
        keras_trainer is not None
        and "get_metrics_result" not in model.__dict__
        and type(model).get_metrics_result is keras_trainer.get_metrics_result
    ):
        return super(keras_trainer, model).get_metrics_result
    return model.get_metrics_result


def keras_step(model, name):
    """Whether `model`'s `name` step (`"train_step"`, ...) is Keras's own.

    Keras's own train and test steps return `compute_metrics(...)`, which
    reads the metrics through `get_metrics_result` (made global there, when
    step logs are read): their logs need nothing more. A subclass's or an
    object's own step may return anything.

    Args:
        model: the Keras model.
        name: the step's attribute name.

    Returns:
        True if neither the model nor its class replaces Keras's step.
    """
    return name not in vars(model) and getattr(type(model), name, None) is getattr(
        KerasModel, name
    )
