"""Saving and loading a `DistributedModel` with Keras's own `.keras` format.

`model.save` and `keras.saving.load_model` stay Keras's own. The class is
written as Keras's `Functional` (`Sequential`) under its registered name: it
loads as that class where given, else as a plain Keras model. A class that
overrides `compile` is still compiled from its config, and the distribution
goes in the assets, not in the compile config Keras passes to `compile`.
"""

import contextlib
import json
import os
import warnings

import numpy as np

from keras_parallel.keras_seam.replacements import replaced

#: The file in the model's assets that describes its distribution.
DISTRIBUTION_ASSET = "keras_parallel_distribution.json"
#: The format of that file; a newer one is refused with a warning.
DISTRIBUTION_FORMAT = 1
#: keras_parallel's `DataParallel` options a description keeps.
_DATA_PARALLEL_OPTIONS = ("sync_batchnorm", "find_unused_parameters")


#: The keys of a Functional model's config (`Functional.get_config`).
_FUNCTIONAL_KEYS = {"name", "trainable", "layers", "input_layers", "output_layers"}


def keras_class_for(cls, inner_config):
    """The Keras class that can revive a model of `cls` from its config.

    Args:
        cls: a `DistributedModel` subclass.
        inner_config: what its `get_config()` returned, serialized.

    Returns:
        `Functional` or `Sequential`, or `None` when the config needs `cls`
        itself (its own `__init__`, or a `get_config` of its own).
    """
    if not isinstance(inner_config, dict):
        return None
    import keras

    from keras_parallel.keras_seam.keras_compat import Functional

    sequential, functional = keras.Sequential, Functional
    if issubclass(cls, sequential):
        # Sequential.from_config reads its own keys; a subclass that keeps
        # Sequential's constructor and config revives as one.
        own = cls.__init__ is sequential.__init__ and cls.get_config is (
            sequential.get_config
        )
        return sequential if own else None
    if issubclass(cls, functional):
        # Keras writes a functional config only for a functional-like
        # constructor; extra keys would be passed to Functional's constructor.
        keys = set(inner_config)
        required = _FUNCTIONAL_KEYS - {"trainable"}
        return functional if required <= keys <= _FUNCTIONAL_KEYS else None
    return None


@contextlib.contextmanager
def saved_as_keras_class(distributed_base):
    """While in scope, a DistributedModel's config names a Keras class.

    Wraps `serialization_lib.serialize_with_public_class`, which
    `serialize_keras_object` calls with the object's class to write its
    `module`, `class_name` and `registered_name`. For a `DistributedModel`
    subclass that a Keras class can revive (see `keras_class_for`), those
    name the Keras class and keep the subclass's registered name, which Keras
    looks up first at load. Every other class is written as before.

    Args:
        distributed_base: `DistributedModel` (given by it: saving sits
            below the model in the package's layers).
    """
    from keras_parallel.keras_seam.keras_compat import serialization_lib as module

    original = module.serialize_with_public_class

    def serialize_with_public_class(cls, inner_config=None):
        config = original(cls, inner_config=inner_config)
        if not (isinstance(cls, type) and issubclass(cls, distributed_base)):
            return config
        keras_class = keras_class_for(cls, inner_config)
        if keras_class is None:
            return config
        from keras.saving import get_registered_name

        return {
            # Keras imports a class from its own modules only, so the
            # defining module (not the `keras` API name: Keras refuses a
            # registered name on an API-exported class) is written.
            "module": keras_class.__module__,
            "class_name": keras_class.__name__,
            "config": inner_config,
            "registered_name": get_registered_name(cls),
        }

    with replaced(
        {(module, "serialize_with_public_class"): serialize_with_public_class}
    ):
        yield


def compile_from_config(model, config):
    """Compiles a loaded model from its saved compile config, as Keras does.

    Mirrors `keras.Model.compile_from_config`, which skips every class that
    overrides `compile`. The distribution is applied after, from the assets
    (`saved_binding`).

    Args:
        model: the loaded `DistributedModel`.
        config: the saved compile config.
    """
    import keras

    config = keras.saving.deserialize_keras_object(config)
    model.compile(**config)
    if hasattr(model, "optimizer") and model.built:
        # Keras loads the optimizer's saved variables into the variables that
        # exist when the weights are read: build them now, as Keras does.
        model.optimizer.build(model.trainable_variables)


def describe_distribution(distribution):
    """A JSON-able description of a distribution, enough to re-create it.

    Args:
        distribution: a `keras.distribution.Distribution`.

    Returns:
        A dict: `kind` (`"DataParallel"`, `"ModelParallel"` or the class
        name), the mesh's `mesh_shape` and `axis_names`, `batch_dim_name`,
        `auto_shard_dataset`, and for ModelParallel the `layout_map` (each key
        to its axes) and the `rules`; keras_parallel's `DataParallel` options and `shard=`
        (with `shard_min_size`) too.
    """
    import keras

    mesh = distribution.device_mesh
    description = {
        "format": DISTRIBUTION_FORMAT,
        "kind": type(distribution).__name__,
        "mesh_shape": [int(n) for n in mesh.shape],
        "axis_names": list(mesh.axis_names),
        "batch_dim_name": distribution.batch_dim_name,
        "auto_shard_dataset": bool(getattr(distribution, "auto_shard_dataset", True)),
    }
    if isinstance(distribution, keras.distribution.ModelParallel):
        description["kind"] = "ModelParallel"
        layout_map = getattr(distribution, "_layout_map", None) or {}
        description["layout_map"] = {
            key: list(layout_map[key].axes) for key in layout_map
        }
        rules = getattr(distribution, "rules", None)
        if rules is not None:
            description["rules"] = (
                rules if isinstance(rules, str) else [list(rule) for rule in rules]
            )
    elif isinstance(distribution, keras.distribution.DataParallel):
        description["kind"] = "DataParallel"
        for option in _DATA_PARALLEL_OPTIONS:
            if hasattr(distribution, option):
                description[option] = bool(getattr(distribution, option))
    if getattr(distribution, "shard", None) is not None:
        description["shard"] = distribution.shard
        description["shard_min_size"] = int(distribution.shard_min_size)
    return description


def _present(description, keys):
    return {key: description[key] for key in keys if key in description}


def _mesh_text(description):
    shape = tuple(description.get("mesh_shape", ()))
    names = tuple(description.get("axis_names", ()))
    return f"{description.get('kind')} over a {shape} mesh {names}"


def distribution_from_description(description):
    """Re-creates a saved distribution over this process's devices.

    DataParallel spans every local device (`keras_parallel.DataParallel()`),
    whatever the saved count. ModelParallel keeps the mesh shape, axis
    names, batch axis and LayoutMap, laid over the local devices when their
    count equals the mesh size.

    Args:
        description: what `describe_distribution` returned.

    Returns:
        The distribution, or `None` (with a warning saying why and what to
        do) when it cannot be re-created here.
    """
    import keras

    from keras_parallel.backends import executor_class
    from keras_parallel.distribution import DataParallel, ModelParallel

    kind = description.get("kind")
    remedy = (
        "the model is loaded on one device; compile it again with a "
        "distribution for this machine: model.compile(..., distribution=...)"
    )
    if description.get("format", 0) > DISTRIBUTION_FORMAT:
        warnings.warn(
            "The model's saved distribution was written by a newer "
            f"keras_parallel. Received: format {description.get('format')}, "
            f"this one reads {DISTRIBUTION_FORMAT}; {remedy}.",
            stacklevel=3,
        )
        return None
    sharding = _present(description, ("shard", "shard_min_size"))
    if kind == "DataParallel":
        options = _present(description, _DATA_PARALLEL_OPTIONS) | sharding
        return DataParallel(
            auto_shard_dataset=description.get("auto_shard_dataset", True), **options
        )
    if kind != "ModelParallel":
        warnings.warn(
            "The model was saved with a distribution keras_parallel cannot "
            f"re-create. Received: {kind}; {remedy}.",
            stacklevel=3,
        )
        return None
    shape = tuple(description["mesh_shape"])
    devices = list(executor_class().list_devices())
    if len(devices) != int(np.prod(shape)):
        warnings.warn(
            f"The model was saved with {_mesh_text(description)} of "
            f"{int(np.prod(shape))} devices, which this process cannot lay out. "
            f"Received: {len(devices)} local device(s); {remedy}.",
            stacklevel=3,
        )
        return None
    mesh = keras.distribution.DeviceMesh(
        shape, list(description["axis_names"]), devices=devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in description.get("layout_map", {}).items():
        layout_map[key] = tuple(axes)
    rules = description.get("rules")
    return ModelParallel(
        layout_map=layout_map,
        rules=rules
        if rules is None or isinstance(rules, str)
        else [tuple(r) for r in rules],
        batch_dim_name=description.get("batch_dim_name"),
        auto_shard_dataset=description.get("auto_shard_dataset", True),
        **sharding,
    )


def save_distribution(distribution, dir_path):
    """Writes the distribution's description into the model's assets.

    Args:
        distribution: the model's distribution, or `None` (nothing written).
        dir_path: the model's assets folder, as Keras gives it.
    """
    if distribution is None:
        return
    with open(os.path.join(dir_path, DISTRIBUTION_ASSET), "w") as f:
        json.dump(describe_distribution(distribution), f, indent=1)


def saved_binding(model, dir_path, binding_class):
    """The binding of a loaded, compiled model's saved distribution.

    None when none was saved, when the model was loaded uncompiled
    (`compile=False`: its `compile` call gives the distribution), or when the
    saved one does not fit it here (a warning says so). The plan is checked
    now; the model binds it, and it is applied, with the loaded weights and
    optimizer state, when the first entry point makes its step, as after
    `compile(..., distribution=...)` on an unbuilt model.

    Args:
        model: the loaded `DistributedModel`.
        dir_path: its assets folder, as Keras gives it.
        binding_class: `keras_parallel.run.binding.Binding` (given by the model:
            saving sits below the binding in the package's layers).

    Returns:
        A `Binding`, or None.
    """
    path = os.path.join(dir_path, DISTRIBUTION_ASSET)
    if not os.path.exists(path) or not getattr(model, "compiled", False):
        return None
    with open(path) as f:
        description = json.load(f)
    distribution = distribution_from_description(description)
    if distribution is None:
        return None
    try:
        binding = binding_class(distribution)
        binding.resolve(model)
    except ValueError as error:
        warnings.warn(
            f"The model's saved {_mesh_text(description)} does not fit it "
            f"here, so it is loaded on one device. Received: {error}; compile "
            "it again with a distribution that fits: "
            "model.compile(..., distribution=...).",
            stacklevel=3,
        )
        return None
    return binding
