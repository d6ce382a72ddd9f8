"""The Keras internals the TensorFlow backend reads or patches, in one place.

Checked as `keras_parallel.keras_seam.keras_compat` says, against Keras 3.15.0, 3.15.1
and keras-nightly 3.16.0.dev2026102704.
"""

from tensorflow.python.distribute import (
    collective_all_reduce_strategy,
    cross_device_utils,
    mirrored_strategy,
)

from keras_parallel.keras_seam.keras_compat import find, internal, internal_any
from keras_parallel.keras_seam.replacement_targets import Target

#: Keras's TensorFlow trainer (`exact.patched`).
trainer = internal(
    "keras.src.backend.tensorflow.trainer",
    "reduce_per_replica",
    "TFEpochIterator._get_iterator",
)
#: The trainer class: `TensorFlowTrainer` up to 3.15, `Trainer` from 3.16.
TensorFlowTrainer = internal_any(
    "keras.src.backend.tensorflow.trainer", "TensorFlowTrainer", "Trainer"
)
find(TensorFlowTrainer, "_maybe_symbolic_build", "TensorFlowTrainer")
#: Keras's per-replica loss scaling (`exact.exact_scale_loss`).
loss = internal(
    "keras.src.losses.loss",
    "scale_loss_for_distribution",
    "unscale_loss_for_distribution",
)
#: Keras's compiled loss (`exact.per_output_losses`).
CompileLoss = internal(
    "keras.src.trainers.compile_utils", "CompileLoss.call"
).CompileLoss
#: Keras's NumPy array adapter, which shuffles (`workers.numpy_shuffles`).
ArrayDataAdapter = internal(
    "keras.src.trainers.data_adapters.array_data_adapter",
    "ArrayDataAdapter.get_tf_dataset",
).ArrayDataAdapter
tree = internal("keras.src.tree", "flatten", "map_structure")

#: The data adapters whose `get_tf_dataset` `divided_input` replaces, and
#: what it reads of Keras's to make batches as Keras does.
_adapters = "keras.src.trainers.data_adapters"
_ADAPTER_CLASSES = (
    ("generator_data_adapter", "GeneratorDataAdapter"),
    ("py_dataset_adapter", "PyDatasetAdapter"),
    ("torch_data_loader_adapter", "TorchDataLoaderAdapter"),
    ("tf_dataset_adapter", "TFDatasetAdapter"),
)
DATA_ADAPTERS = tuple(
    getattr(internal(f"{_adapters}.{module}", f"{name}.get_tf_dataset"), name)
    for module, name in _ADAPTER_CLASSES
)
internal(f"{_adapters}.py_dataset_adapter", "PyDatasetAdapter._standardize_batch")
internal(
    f"{_adapters}.generator_data_adapter", "GeneratorDataAdapter.get_numpy_iterator"
)
data_adapter_utils = internal(f"{_adapters}.data_adapter_utils", "get_numpy_iterator")
#: Made synchronized by `exact.synchronized_batchnorm`.
BatchNormalization = internal(
    "keras.src.layers.normalization.batch_normalization", "BatchNormalization"
).BatchNormalization

#: Its gradients are summed first (`summed_gradients`).
TFOptimizer = internal(
    "keras.src.backend.tensorflow.optimizer",
    "TFOptimizer._backend_apply_gradients",
    "TFOptimizer._all_reduce_sum_gradients",
).TFOptimizer

#: TensorFlow's own internals (`summed_gradients`, `collective_keys`).
MirroredExtended = mirrored_strategy.MirroredExtended
CollectiveAllReduceExtended = collective_all_reduce_strategy.CollectiveAllReduceExtended
CollectiveReplicaLauncher = cross_device_utils.CollectiveReplicaLauncher

#: Keras's saving, whose reference objects `saving_references.py` makes early.
saving_lib = internal("keras.src.saving.saving_lib", "get_attr_skipset")

#: What the TensorFlow backend replaces, through `keras_parallel.keras_seam.replacements`.
REPLACED = (
    Target(
        "keras.src.saving.saving_lib",
        "get_attr_skipset",
        "saving's reference objects made outside any strategy (`saving_references.py`)",
    ),
    Target(
        "keras.src.losses.loss",
        ("scale_loss_for_distribution", "unscale_loss_for_distribution"),
        "each replica's loss weighted by its share of the batch: exact for "
        "uneven batches; its value one whose mean over the replicas is the "
        "loss, for a custom step to log (`exact.patched`)",
    ),
    Target(
        "keras.src.trainers.compile_utils.CompileLoss",
        "call",
        "each output's logged loss (several outputs) weighted as one device "
        "weighs it, by step when batch sizes differ (`exact.patched`)",
    ),
    Target(
        "keras.src.backend.tensorflow.trainer",
        "reduce_per_replica",
        "each step's logs global, not the replicas' mean (`exact.patched`)",
    ),
    *(
        Target(
            f"keras.src.backend.tensorflow.trainer.{name}",
            "_maybe_symbolic_build",
            "the model built from the data's element spec: no batch drawn "
            "(a generator loses none), any split (`exact.patched`; Keras "
            f"{version})",
            optional=True,
        )
        for name, version in (("TensorFlowTrainer", "3.15"), ("Trainer", "3.16+"))
    ),
    Target(
        "keras.src.backend.tensorflow.trainer.TFEpochIterator",
        "_get_iterator",
        "the data distributed under a strategy applied after the iterator "
        "was made, an unbuilt model built before `predict` (`exact.patched`)",
    ),
    Target(
        "keras.src.backend.tensorflow.optimizer.TFOptimizer",
        ("_backend_apply_gradients", "_all_reduce_sum_gradients"),
        "gradients summed over the replicas before they are clipped or "
        "accumulated, as one device clips the whole gradient "
        "(`summed_gradients.gradients_summed_first`)",
    ),
    *(
        Target(
            f"tensorflow.python.distribute.{module}.{name}",
            "_use_merge_call",
            "no `merge_call` while summed gradients are applied: the update "
            "runs in each replica, inside the accumulation's `tf.cond` too "
            "(`summed_gradients.no_merge_call_on_summed`)",
        )
        for module, name in (
            ("mirrored_strategy", "MirroredExtended"),
            ("collective_all_reduce_strategy", "CollectiveAllReduceExtended"),
        )
    ),
    Target(
        "tensorflow.python.distribute.cross_device_utils.CollectiveReplicaLauncher",
        "_use_unique_instance_key",
        "a step traced inside control flow (`steps_per_execution > 1`) keys "
        "its collectives when traced, not with inputs `tf.cond` drops "
        "(`collective_keys.static_keys_in_control_flow`)",
    ),
    Target(
        "keras.src.layers.normalization.batch_normalization.BatchNormalization",
        "synchronized",
        "global batch statistics (`exact.synchronized_batchnorm`)",
        on_instances=True,
    ),
    Target(
        "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter",
        "get_tf_dataset",
        "across workers, the epoch's shuffle drawn from NumPy "
        "(`workers.numpy_shuffles`)",
    ),
    *(
        Target(
            f"keras.src.trainers.data_adapters.{module}.{name}",
            "get_tf_dataset",
            "across workers, each worker prepares only its rows of each "
            "global batch (`divided_input`)",
        )
        for module, name in _ADAPTER_CLASSES
    ),
    Target(
        "tensorflow.random",
        "shuffle",
        "across workers, NumPy's permutation, one shuffle for all "
        "(`workers.numpy_shuffles`)",
    ),
    Target(
        "tensorflow.python.distribute.collective_all_reduce_strategy."
        "CollectiveAllReduceExtended",
        "_initialize_local_devices",
        "across workers, one replica per logical CPU device "
        "(`workers.ExactMultiWorkerMirroredStrategy`)",
    ),
)

#: Attributes of Keras objects the TensorFlow backend reads or sets.
OBJECT_ATTRIBUTES = {
    # `variables.py`.
    "keras.Variable": ("_value", "_map_aggregation", "_map_synchronization"),
    "keras.Model": ("_distribute_strategy", "_symbolic_build", "_flatten_layers"),
    "keras.optimizers.Optimizer": (
        "_distribution_strategy",
        "_var_key",
        "_trainable_variables_indices",
    ),
}

#: Attributes of Keras objects that exist only in some states: not checked.
UNCHECKED_ATTRIBUTES = {
    # Made when it first iterates (`element_spec_build.py`).
    "TFEpochIterator (iterating)": ("_distributed_dataset",),
}

#: Private names of TensorFlow keras_parallel uses.
OTHER_PRIVATE_NAMES = {
    # `element_spec_build.py`.
    "tf.distribute PerReplicaSpec": ("_component_specs",),
    # `workers.py`.
    "MultiWorkerMirroredStrategy.extended": ("_num_workers", "_task_id"),
}
