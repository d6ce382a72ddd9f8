"""Test set-up shared by every backend.

The backend is chosen by `KERAS_BACKEND` (tox sets it per env). Simulated
devices must exist before the backend starts, so they are set up here,
before any test module imports Keras:

- JAX: 8 CPU devices via `XLA_FLAGS`.
- TensorFlow: logical CPU devices, see `tests/tf_devices.py`.
"""

import os

import pytest
import suite_timing

os.environ.setdefault("KERAS_BACKEND", "jax")
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

if os.environ["KERAS_BACKEND"] == "tensorflow":
    # Logical CPU devices must exist before TensorFlow starts its runtime.
    import tf_devices

    tf_devices.setup()

    import gc

    @pytest.fixture(autouse=True)
    def _collect_tensorflow_garbage():
        """Frees each test's TensorFlow objects when it ends.

        A `tf.data` iterator a test left (a `fit` that raised) is otherwise
        freed by a later collection, which may come while a later test's
        `MirroredStrategy` traces its step: its destructor then waits on the
        iterator's threads for 30 to 100 s (seen: one test taking 4 s alone
        and 100 s after the others).
        """
        yield
        gc.collect()
        # What survives (modules, module-scoped fixtures) is left out of
        # later collections, so that each test's collection reads only
        # what that test made: a full one reads TensorFlow's and Keras's
        # whole heap, 0.16 s a test on an idle machine (0.4 s busy), over
        # 800 tests of the tensorflow env.
        gc.freeze()


def pytest_configure(config):
    suite_timing.register(config)


@pytest.fixture
def recorded_steps(monkeypatch):
    """JAX: the last compiled train step and its arguments, as it is called.

    `compiled.lower(*args).compile().as_text()` is then its optimized HLO
    (the collectives a step runs).
    """
    from keras_parallel.backends.jax import batches

    calls = []
    original = batches.jit_splitting_batches

    def recording(function, *args, **kwargs):
        compiled = original(function, *args, **kwargs)

        def call(*step_args):
            calls[:] = [(compiled, step_args)]  # The last step only.
            return compiled(*step_args)

        return call

    monkeypatch.setattr(batches, "jit_splitting_batches", recording)
    return calls
