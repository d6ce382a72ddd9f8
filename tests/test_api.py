"""The public API imports, and importing it loads no backend of its own."""

import subprocess
import sys

import keras
import pytest

import keras_parallel

PUBLIC = [
    "Auto",
    "DataParallel",
    "DistributedModel",
    "ChiefWriteError",
    "ModelParallel",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "ShardingCallback",
    "ShardingError",
    "ShardingWarning",
    "ThroughputMonitor",
    "UnmatchedLayoutKeyWarning",
    "describe",
    "launch",
    "restore_checkpoint",
    "split_cpu",
]


# Names that need their backend's library installed.
NEEDS = {"split_cpu": "tensorflow"}


def test_public_names_import():
    import importlib.util

    for name in PUBLIC:
        needed = NEEDS.get(name)
        if needed and importlib.util.find_spec(needed) is None:
            continue
        assert getattr(keras_parallel, name) is not None
    assert sorted(keras_parallel.__all__) == sorted(PUBLIC)


def test_import_loads_no_keras_and_no_backend():
    code = (
        "import sys, keras_parallel; "
        "loaded = [m for m in ('keras', 'jax', 'torch', 'tensorflow') if m in sys.modules]; "
        "print(loaded)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "[]"


def test_mixin_after_keras_model_is_refused_at_class_creation():
    with pytest.raises(
        TypeError, match=r"DistributedModel must come before keras.Model"
    ) as raised:

        class Wrong(keras.Model, keras_parallel.DistributedModel):
            pass

    assert "class Wrong(keras_parallel.DistributedModel, keras.Model)" in str(
        raised.value
    )


def test_subclass_of_a_distributed_model_is_accepted():
    class Base(keras_parallel.DistributedModel, keras.Model):
        pass

    class Child(Base):
        pass

    assert issubclass(Child, keras_parallel.DistributedModel)
