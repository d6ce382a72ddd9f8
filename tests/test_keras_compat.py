"""Every Keras internal keras_parallel uses exists in the installed Keras.

Module-level internals are checked when each `keras_compat` module is
imported; the attributes of Keras objects are checked here, on real objects
of the running backend, so each tox env (oldest Keras, latest, nightly)
proves its Keras has them all.
"""

import ast
import importlib
import tempfile

import keras
import numpy as np
import pytest

from keras_parallel.errors import UnsupportedKerasError
from keras_parallel.keras_seam import keras_compat

BACKEND = keras.backend.backend()


def _owners():
    """One real object per owner name used in the OBJECT_ATTRIBUTES lists."""
    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization()(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((8, 4)), np.zeros((8, 2)), verbose=0)
    # keras.distribution.list_devices() fails on torch (Keras 3.15).
    mesh = keras.distribution.DeviceMesh((1,), ["model"], ["cpu:0"])
    model_parallel = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="model"
    )
    from keras.src.trainers.data_adapters.py_dataset_adapter import (
        PyDatasetAdapter,
    )

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return np.zeros((2, 4)), np.zeros((2, 2))

    owners = {}
    try:
        import tensorflow as tf
        from keras.src.trainers.data_adapters.tf_dataset_adapter import (
            TFDatasetAdapter,
        )

        owners["TFDatasetAdapter"] = TFDatasetAdapter(tf.data.Dataset.range(2).batch(1))
        made = PyDatasetAdapter(Batches(), shuffle=False)
        made.get_tf_dataset()
        owners["PyDatasetAdapter (its tf.data signature made)"] = made
    except ImportError:  # Without TensorFlow, no tf.data input.
        pass
    try:
        import torch
        from keras.src.trainers.data_adapters.torch_data_loader_adapter import (
            TorchDataLoaderAdapter,
        )

        loader = torch.utils.data.DataLoader(torch.zeros(4, 2), batch_size=2)
        owners["TorchDataLoaderAdapter"] = TorchDataLoaderAdapter(loader)
    except ImportError:  # Without torch, no user gives a DataLoader.
        pass
    return {
        **owners,
        "PyDatasetAdapter": PyDatasetAdapter(Batches(), shuffle=False),
        "keras.distribution.ModelParallel": model_parallel,
        "keras.Model": model,
        "keras.Model (after fit)": model,
        "keras.Variable": model.weights[0],
        "keras.layers.BatchNormalization": model.layers[1],
        "keras.layers.Layer": model.layers[2],
        "keras.optimizers.Optimizer": model.optimizer,
        "keras.callbacks.BackupAndRestore": keras.callbacks.BackupAndRestore(
            tempfile.mkdtemp()
        ),
    }


#: Owners made only where their backend is installed (torch, TensorFlow).
_NEEDS_ANOTHER_BACKEND = (
    "TorchDataLoaderAdapter",
    "TFDatasetAdapter",
    "PyDatasetAdapter (its tf.data signature made)",
)


def _lists():
    lists = [keras_compat.OBJECT_ATTRIBUTES]
    module = importlib.import_module(f"keras_parallel.backends.{BACKEND}.keras_compat")
    lists.append(module.OBJECT_ATTRIBUTES)
    return lists


def test_every_listed_object_attribute_exists():
    owners = _owners()
    missing = [
        f"{owner}.{name}"
        for listing in _lists()
        for owner, names in listing.items()
        for name in names
        if (owner in owners or owner not in _NEEDS_ANOTHER_BACKEND)
        and not hasattr(owners[owner], name)
    ]
    assert not missing, f"keras=={keras.version()} lacks {missing}"


def test_backend_executor_imports_with_this_keras():
    from keras_parallel.backends import executor_class

    assert executor_class().backend == BACKEND


def test_missing_module_names_version_and_range():
    with pytest.raises(UnsupportedKerasError) as info:
        keras_compat.internal("keras.src.no_such_module")
    message = str(info.value)
    assert "keras.src.no_such_module" in message
    assert f"keras=={keras.version()}" in message
    assert keras_compat.SUPPORTED_KERAS in message


def test_missing_attribute_names_it():
    with pytest.raises(UnsupportedKerasError, match=r"model.*no_such_name"):
        keras_compat.internal("keras.src.models.model", "Model.no_such_name")


def test_older_keras_than_required_is_refused():
    keras_compat.require_keras((3, 0))
    with pytest.raises(UnsupportedKerasError, match=r"needs `Keras >= 99.1`"):
        keras_compat.require_keras((99, 1))


def test_renamed_internal_takes_the_name_that_exists():
    module = "keras.src.models.model"
    found = keras_compat.internal_any(module, "NoSuchOldName", "Model")
    assert found is importlib.import_module(module).Model
    with pytest.raises(UnsupportedKerasError, match="A or B"):
        keras_compat.internal_any(module, "A", "B")


def test_supported_range_matches_pyproject():
    import pathlib

    import tomllib

    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert f"keras{keras_compat.SUPPORTED_KERAS}" in deps
    minimum = ".".join(map(str, keras_compat.MINIMUM_KERAS))
    assert keras_compat.SUPPORTED_KERAS == f">={minimum}"


# ---------------------------------------------------------- replacements
MISSING = object()


def _tables():
    """`{label: REPLACED}` of the shared table and this backend's."""
    module = importlib.import_module(f"keras_parallel.backends.{BACKEND}.keras_compat")
    return {"every backend": keras_compat.REPLACED, BACKEND: module.REPLACED}


def _targets():
    return [target for targets in _tables().values() for target in targets]


def _instances():
    """Real objects to look instance attributes up on."""
    model = _owners()["keras.Model"]
    attention = keras.layers.MultiHeadAttention(num_heads=1, key_dim=2)
    return [
        model,
        model.optimizer,
        *model.layers,
        attention,
        *model.weights,
        *model.metrics,
    ]


def test_every_replaced_target_exists_in_this_keras():
    instances = _instances()
    missing = []
    for target in _targets():
        owner = target.resolve_owner()
        if owner is None:
            if not target.optional:
                missing.append(target.owner)
            continue
        if target.on_instances:
            objects = [o for o in instances if isinstance(o, owner)]
            if not objects:
                missing.append(f"an object of {target.owner}")
                continue
            owner = objects[0]
        missing += [
            f"{target.owner}.{name}"
            for name in target.names
            if not hasattr(owner, name) and not target.optional
        ]
    assert not missing, f"keras=={keras.version()} lacks {missing}"


def _class_and_module_attributes():
    """What every class- and module-level target holds now (its own value)."""
    found = {}
    for target in _targets():
        owner = target.resolve_owner()
        if owner is None or target.on_instances:
            continue
        for name in target.names:
            found[(target.owner, name)] = vars(owner).get(name, MISSING)
    return found


def _changed(before, after):
    return sorted(key for key in before if before[key] is not after[key])


def _distributed_model(seed=0):
    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization()(inputs)
    model = Net(inputs, keras.layers.Dense(2)(x))
    devices = None
    if BACKEND == "tensorflow":
        import tf_devices

        devices = tf_devices.devices(2)
    model.compile(
        optimizer="sgd",
        loss="mse",
        distribution=keras_parallel.DataParallel(devices=devices),
    )
    return model


def _data():
    return np.ones((32, 4), "float32"), np.ones((32, 2), "float32")


def test_replacements_are_restored_after_fit_and_a_failing_fit():
    before = _class_and_module_attributes()
    model = _distributed_model()
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0)
    assert _changed(before, _class_and_module_attributes()) == []

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[Boom()])
    assert _changed(before, _class_and_module_attributes()) == []


def test_a_model_run_inside_another_fit_keeps_the_outer_replacements():
    outer, inner = _distributed_model(), _distributed_model(seed=1)
    x, y = _data()
    seen = {}

    class EvaluateAnother(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                seen["before"] = _class_and_module_attributes()
                inner.evaluate(x, y, batch_size=8, verbose=0)
                seen["after"] = _class_and_module_attributes()

    before = _class_and_module_attributes()
    outer.fit(x, y, batch_size=8, verbose=0, callbacks=[EvaluateAnother()])
    assert _changed(seen["before"], seen["after"]) == []
    assert _changed(before, _class_and_module_attributes()) == []


def test_replacements_restore_what_they_found_newest_first():
    from keras_parallel.keras_seam.replacements import Replacements

    trainer = keras_compat.EpochIterator
    own = vars(trainer).get("_enumerate_iterator")
    outer, nested = Replacements(), Replacements()
    outer.replace(trainer, "_enumerate_iterator", "outer")
    nested.replace(trainer, "_enumerate_iterator", "nested")
    nested.restore()
    assert vars(trainer)["_enumerate_iterator"] == "outer"
    outer.restore()
    assert vars(trainer).get("_enumerate_iterator") is own

    # An attribute replaced on an object is put back as it was there: its
    # own value, or none (an inherited one). JAX replaces none on objects.
    instances = [*_instances(), keras.layers.BatchNormalization()]
    for target in _targets():
        owner = target.resolve_owner()
        if not target.on_instances or target.names == ("__class__",) or not owner:
            continue
        found = [o for o in instances if isinstance(o, owner)]
        if found:
            obj, name = found[0], target.names[0]
            own = vars(obj).get(name, MISSING)
            outer.replace(obj, name, "replaced")
            assert getattr(obj, name) == "replaced"
            outer.restore()
            assert vars(obj).get(name, MISSING) is own
            break
    else:
        assert BACKEND == "jax", "no target replaced on objects was tried"


def test_an_unlisted_replacement_is_refused():
    from keras_parallel.keras_seam.replacements import Replacements

    replacements = Replacements()
    with pytest.raises(LookupError, match="without listing it"):
        replacements.replace(keras_compat.EpochIterator, "reset", None)
    assert not replacements


def test_design_doc_lists_every_replaced_target():
    import pathlib

    from keras_parallel.keras_seam.replacement_targets import markdown_rows

    design = pathlib.Path(__file__).parents[1] / "docs" / "design.md"
    rows = [line for line in design.read_text().splitlines() if line.startswith("|")]
    for label, targets in _tables().items():
        expected = markdown_rows(label, targets)
        documented = [row for row in rows if row.startswith(f"| {label} |")]
        assert documented == expected, (
            f"docs/design.md's table of replaced targets differs from "
            f"REPLACED ({label}); write these rows there:\n" + "\n".join(expected)
        )


# ---------------------------------------------------------- private names
def test_every_private_name_the_source_uses_is_listed():
    # Scanned from every backend's modules: a private name of Keras (or of
    # a backend) used anywhere must be in a registry, and so checked here.
    import private_names

    unlisted = {
        name: places
        for name, places in private_names.foreign_private_names().items()
        if name not in private_names.listed_names()
    }
    assert not unlisted, (
        "private names of other packages used but not listed in a "
        f"keras_compat module: {unlisted}"
    )


def test_keras_src_is_imported_by_the_compat_modules_only():
    import private_names

    assert private_names.keras_src_imports() == []


def test_the_scan_finds_what_it_must_and_only_that():
    import private_names

    source = """
import keras

class Own:
    def __init__(self):
        self._mine = 1

    def read(self, model):
        return self._mine, model._keras_private


class Backup(keras.callbacks.BackupAndRestore):
    def on_train_begin(self, logs=None):
        self._assigned_here = 0
        return self._kept_by_keras, self._assigned_here


def installed_on_keras(self):
    return self._set_by_keras
"""
    found = private_names.foreign_private_names([("m.py", ast.parse(source))])
    assert set(found) == {"_keras_private", "_kept_by_keras", "_set_by_keras"}
