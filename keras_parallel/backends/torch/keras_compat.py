"""The Keras internals the torch backend reads or patches, in one place.

See `keras_parallel.keras_seam.keras_compat` for why and how these are checked.
Checked against Keras 3.15.0, 3.15.1 and keras-nightly 3.16.0.dev2026102704.
"""

from keras_parallel.keras_seam.keras_compat import find, internal, internal_any
from keras_parallel.keras_seam.replacement_targets import Target

#: Keras 3.16's torch `Trainer` (3.15's is `TorchTrainer`), which wraps the model
#: in its own DDP and sums metric states over ranks; `None` before 3.16.
_trainer = internal("keras.src.backend.torch.trainer")
torch_trainer_with_ddp = getattr(_trainer, "Trainer", None)
if torch_trainer_with_ddp is not None:
    internal(
        "keras.src.backend.torch.trainer",
        "Trainer.get_metrics_result",
        "Trainer._initialize_ddp",
    )
#: Keras's torch trainer class (3.16's `Trainer`, 3.15's `TorchTrainer`), and
#: the method it asks whether `jit_compile=True` compiles its whole step
#: functions (3.15's name, then 3.16's): `trainer.TorchTrainer` answers no to
#: both, and `steps` compiles the model's forward pass instead.
keras_torch_trainer = internal_any(
    "keras.src.backend.torch.trainer", "Trainer", "TorchTrainer"
)
TORCH_COMPILE_CHOICES = ("_should_torch_compile", "_use_torch_compile")
if not any(hasattr(keras_torch_trainer, name) for name in TORCH_COMPILE_CHOICES):
    find(keras_torch_trainer, " or ".join(TORCH_COMPILE_CHOICES))
#: The epoch iterator of Keras's torch trainer (`same_data`, `divided_input`).
TorchEpochIterator = internal(
    "keras.src.backend.torch.trainer",
    "TorchEpochIterator.__iter__",
    "TorchEpochIterator._get_iterator",
).TorchEpochIterator
#: Arrays: the only adapter whose public sizes tell its exact row count.
ArrayDataAdapter = internal(
    "keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter"
).ArrayDataAdapter
#: The adapters whose batches the ranks share (`shared_batches`).
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
#: Keras's `Model`: its own steps (`keras_step`) and its epoch logs (`steps`).
KerasModel = internal(
    "keras.src.models.model",
    "Model.train_step",
    "Model.test_step",
    "Model._get_metrics_result_or_logs",
).Model

#: Keras 3.16's own torch DTensor support, used by `dtensor_layouts`; `None`
#: with Keras 3.15.
keras_dtensor = getattr(internal("keras.src.backend"), "distribution_lib", None)
if keras_dtensor is not None and not all(
    hasattr(keras_dtensor, name)
    for name in ("distribute_tensor", "_to_backend_mesh", "_to_backend_layout")
):
    keras_dtensor = None  # Some other torch distribution_lib: use torch's API.

#: The module behind `keras.distribution.list_devices()`; its torch
#: `distribution_lib` is `None` before Keras 3.16 (`distribution_lib.provide`).
keras_distribution = internal(
    "keras.src.distribution.distribution_lib",
    "distribution_lib",
    "list_devices",
    "get_device_count",
)
#: The device Keras's torch backend computes on (`"cpu"`, `"cuda"`, ...).
get_device = (
    internal("keras.src.backend.torch.core", "get_device").get_device
    if keras_dtensor is None
    else keras_dtensor.get_device
)

#: Maps a variable to another value while a layer runs (`output_constraints`,
#: `mesh_losses`).
StatelessScope = internal(
    "keras.src.backend.common.stateless_scope", "StatelessScope"
).StatelessScope

#: Keras's torch `Variable` (`creation.py`), read from `keras.src.backend`:
#: keras-nightly moved it from `torch/core.py` to `torch/ops/core.py`.
TorchVariable = internal(
    "keras.src.backend", "Variable._initialize", "Variable._initialize_with_initializer"
).Variable

#: Keras's optimizer: `_iterations` counts micro-steps, `iterations` updates
#: (`accumulation.py`).
BaseOptimizer = internal(
    "keras.src.optimizers.base_optimizer",
    "BaseOptimizer._backend_apply_gradients",
).BaseOptimizer

#: Attributes of Keras objects the torch backend reads or sets.
OBJECT_ATTRIBUTES = {
    # `dtensor_layouts` and `creation.py`; `_layout` tells Keras 3.16's
    # `_direct_assign` how to redistribute assigned values.
    "keras.Variable": ("_value", "_layout", "_shape"),
    # The axes BatchNormalization's batch statistics reduce (`sync_bn`).
    "keras.layers.BatchNormalization": ("_reduction_axes",),
    # Nested layers (sync BN, ModelParallel); `dtensor_layouts.retrack`.
    "keras.Model": ("_flatten_layers", "_torch_params", "_track_variables"),
    # The losses a forward pass added (`steps`, `mesh_steps`).
    "keras.layers.Layer": ("_losses",),
    # Gradient accumulation under DDP (`accumulation.py`).
    "keras.optimizers.Optimizer": ("_iterations", "gradient_accumulation_steps"),
    # `shared_batches`.
    "PyDatasetAdapter": ("py_dataset", "shuffle"),
}

#: Attributes of Keras objects that exist only in some states; listed, not
#: checked on objects.
UNCHECKED_ATTRIBUTES = {
    # Made only when `gradient_accumulation_steps` is set (`accumulation.py`).
    "keras.optimizers.Optimizer (accumulating)": ("_accumulated_gradients",),
}

#: Private names of torch keras_parallel uses.
OTHER_PRIVATE_NAMES = {
    # Where a failing rank leaves its name (`group.py`).
    "torch.distributed.distributed_c10d": ("_get_default_store",),
    # Where a Keras layer keeps `_torch_params` (`dtensor_layouts.retrack`).
    "torch.nn.Module": ("_modules",),
    # The launch's rendezvous: the ranks of one node share its own store;
    # node 0's static store is made on a socket of ours
    # (`launcher/bound_rendezvous.py`).
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous": (
        "DynamicRendezvousHandler._create_tcp_store_server",
        "DynamicRendezvousHandler._store",
    ),
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous": (
        "StaticTCPRendezvous._store",
    ),
}

#: The model's methods that are the installed steps' own while an entry
#: point runs (`trainer.TorchTrainer`).
TRAINER_STEP_NAMES = (
    "train_step",
    "test_step",
    "predict_step",
    "get_metrics_result",
    "_get_metrics_result_or_logs",
    "call",
)

#: What the torch backend replaces while an entry point runs, through
#: `keras_parallel.keras_seam.replacements`.
REPLACED = (
    Target(
        "keras.src.models.model.Model",
        (*TRAINER_STEP_NAMES, "_get_regularization_losses"),
        "the model's methods while an entry point runs, put on the model "
        "itself (`trainer.py`, `keras_seam/overrides.py`): each rank's rows "
        "through the model's own step, metrics made global, the forward pass "
        "through DDP; weight penalties made whole on DTensor variables",
        on_instances=True,
    ),
    Target(
        "keras.src.models.model.Model",
        TORCH_COMPILE_CHOICES,
        "Keras's whole-step `torch.compile` answered no (`trainer.py`): the "
        "steps compile the model's forward pass instead (3.15's name, then "
        "3.16's)",
        on_instances=True,
        optional=True,
    ),
    Target(
        "keras.src.backend.torch.trainer.TorchEpochIterator",
        ("__iter__", "_get_iterator"),
        "every rank compares the size of its data with the others' before an "
        "epoch's first collective (`same_data.py`); each rank loads only its "
        "rows of a map-style loader's global batches (`divided_input.py`)",
    ),
    Target(
        "keras.src.metrics.reduction_metrics.Mean",
        "update_state",
        "in a custom step, one value per step weighted by the rank's share "
        "of the batch (`update_weights.py`)",
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

    `RankSteps` makes the states global itself: Keras's sum would count each
    row once per rank, at an all-reduce per metric variable per step. A
    subclass's own `get_metrics_result` is left alone.
    """
    if (
        torch_trainer_with_ddp is not None
        and "get_metrics_result" not in model.__dict__
        and type(model).get_metrics_result is torch_trainer_with_ddp.get_metrics_result
    ):
        return super(torch_trainer_with_ddp, model).get_metrics_result
    return model.get_metrics_result


def keras_step(model, name):
    """Whether `model`'s `name` step (`"train_step"`, ...) is Keras's own.

    Keras's own steps return `get_metrics_result`'s logs, made global there; a
    custom step may return anything.
    """
    return name not in vars(model) and getattr(type(model), name, None) is getattr(
        KerasModel, name
    )
