"""The public API imports, and importing it loads no backend of its own."""

import subprocess
import sys

import keras_parallel

PUBLIC = [
    "DataParallel",
    "DistributedModel",
    "ShardingCallback",
    "ShardingError",
    "UnmatchedLayoutKeyWarning",
    "describe",
    "launch",
]


def test_public_names_import():
    for name in PUBLIC:
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
