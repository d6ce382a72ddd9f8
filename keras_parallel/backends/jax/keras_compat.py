"""The Keras internals the JAX backend reads or patches, in one place.

Checked as `keras_parallel.keras_seam.keras_compat` says, against Keras 3.15.0, 3.15.1
and keras-nightly 3.16.0.dev2026102704 (3.10 has no `trainer.jit`; 3.11
records the variables' shardings before keras_parallel lays them out).
"""

from keras_parallel.keras_seam.keras_compat import find, internal, internal_any
from keras_parallel.keras_seam.replacement_targets import Target

#: `jit` compiles Keras's step (`batches.jit_splitting_batches`).
trainer = internal("keras.src.backend.jax.trainer", "jit")
#: Keras's JAX trainer class (3.15's `JAXTrainer`, 3.16's `Trainer`), whose
#: `_make_function` makes the step functions keras_parallel wraps: they take
#: `(state, iterator)` and draw one batch per step (the executor's
#: `first_step_batch`, `_state_kept_on_failure`).
find(
    internal_any("keras.src.backend.jax.trainer", "JAXTrainer", "Trainer"),
    "_make_function",
    "keras.src.backend.jax.trainer trainer class",
)
#: `distribute_data_input` lays out each batch (`batches.distribute_batch`);
#: `initialize` starts `jax.distributed` (`initialize_once`).
distribution_lib = internal(
    "keras.src.backend.jax.distribution_lib", "distribute_data_input", "initialize"
)

#: The data adapters whose `get_jax_iterator` keras_parallel replaces
#: (`batches.refusing_sparse`, `divided_input`), and
#: what it reads of Keras's to make batches as Keras does.
_adapters = "keras.src.trainers.data_adapters"
_ADAPTER_CLASSES = (
    ("array_data_adapter", "ArrayDataAdapter"),
    ("generator_data_adapter", "GeneratorDataAdapter"),
    ("py_dataset_adapter", "PyDatasetAdapter"),
    ("tf_dataset_adapter", "TFDatasetAdapter"),
    ("torch_data_loader_adapter", "TorchDataLoaderAdapter"),
)
DATA_ADAPTERS = tuple(
    getattr(internal(f"{_adapters}.{module}", f"{name}.get_jax_iterator"), name)
    for module, name in _ADAPTER_CLASSES
)
internal(f"{_adapters}.py_dataset_adapter", "PyDatasetAdapter._standardize_batch")
data_adapter_utils = internal(f"{_adapters}.data_adapter_utils", "get_numpy_iterator")
tree = internal("keras.src.tree", "flatten", "map_structure")

#: The module whose `convert_to_numpy` Keras's saving calls
#: (`keras.src.backend` up to 3.15, `keras.src.backend.ops` from 3.16;
#: `processes.gathered_for_saving`).
_backend = internal("keras.src.backend")
numpy_conversion = (
    _backend if hasattr(_backend, "convert_to_numpy") else find(_backend, "ops")
)
find(numpy_conversion, "convert_to_numpy", "keras.src.backend(.ops)")

#: What the JAX backend replaces, through `keras_parallel.keras_seam.replacements`.
REPLACED = (
    Target(
        "keras.src.backend.jax.distribution_lib",
        "distribute_tensor",
        "a value assigned to a laid-out variable (a metric's reset) is "
        "committed to its layout: Keras keeps an uncommitted array whose "
        "sharding is equivalent (one device), and the step, fed committed "
        "state since its first outputs, would compile again "
        "(`planned_distribution.distribute_committed`)",
    ),
    Target(
        "keras.src.backend.jax.distribution_lib",
        "distribute_data_input",
        "a batch the data axis does not divide is placed whole on every "
        "device, for the step to split (Keras reuses the first batch's "
        "layout); across processes each places its own rows "
        "(`batches.distribute_batch`)",
    ),
    Target(
        "keras.src.backend.jax.distribution_lib",
        "initialize",
        "once keras_parallel started `jax.distributed` from a cluster's "
        "variables, a script's own `keras.distribution.initialize()` agreeing "
        "with it does nothing (JAX's raises on a second call); for the life "
        "of the process (`initialize_once.py`)",
    ),
    Target(
        "keras.src.backend.jax.trainer",
        "jit",
        "every batch split inside the step, one the devices do not divide "
        "too; CPU devices: the step compiled without buffer donation "
        "(`batches.jit_splitting_batches`)",
    ),
    *(
        Target(
            f"{_adapters}.{module}.{name}",
            "get_jax_iterator",
            "a sparse batch refused before its step (`batches.refusing_sparse`); "
            "across processes, each process prepares only its share of the "
            "input (`divided_input.py`)",
        )
        for module, name in _ADAPTER_CLASSES
    ),
    *(
        Target(
            module,
            "convert_to_numpy",
            "across processes, saving reads the values every process gathered "
            f"(`processes.gathered_for_saving`; Keras {version})",
            optional=True,
        )
        for module, version in (
            ("keras.src.backend", "3.15"),
            ("keras.src.backend.ops", "3.16+"),
        )
    ),
)

#: Attributes of Keras objects the JAX backend reads or sets.
OBJECT_ATTRIBUTES = {
    "keras.Variable": ("_layout", "_value"),
    # DistributedModel stores Keras's JAX step state untracked (model.py).
    "keras.Model (after fit)": ("_jax_state",),
    # `divided_input.py`.
    "PyDatasetAdapter": ("py_dataset", "shuffle"),
    "TorchDataLoaderAdapter": ("_dataloader",),
}
