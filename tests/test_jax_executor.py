"""The JAX executor's step wrapper on simulated CPU devices.

On several CPU devices each step must have finished on every device before
`fit` may dispatch the next one (overlapping steps can deadlock XLA:CPU's
collectives), and the wrapper must hand Keras the step's outputs unchanged.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX executor; run under tox -e jax"
)


def _step_over_eight_devices():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_parallel.distribution import DataParallel

    distribution = DataParallel()
    mesh = distribution.device_mesh.backend_mesh
    batch = jax.device_put(
        np.arange(64 * 32, dtype="float32").reshape(64, 32),
        NamedSharding(mesh, P("batch")),
    )
    state = [jax.device_put(np.ones((32, 32), "float32"), NamedSharding(mesh, P()))]

    @jax.jit
    def step(state, x):
        # A matmul chain and a mean over the split batch: a collective.
        h = x
        for _ in range(20):
            h = jax.numpy.tanh(h @ state[0])
        loss = h.mean()
        return {"loss": loss}, [state[0] - 1e-3 * loss]

    return distribution, step, state, batch


def test_cpu_step_returns_once_every_device_has_finished():
    from keras_parallel.backends.jax.executor import JaxExecutor

    distribution, step, state, batch = _step_over_eight_devices()
    wrapped = JaxExecutor(distribution).wrap_step(step)
    assert wrapped is not step
    for _ in range(5):
        logs, state = wrapped(state, batch)
        for array in (logs["loss"], state[0]):
            assert len(array.addressable_shards) == 8
            assert array.is_ready()


def test_step_outputs_are_handed_back_unchanged():
    from keras_parallel.backends.jax.executor import JaxExecutor

    distribution, step, state, batch = _step_over_eight_devices()
    expected_logs, expected_state = step(state, batch)
    logs, new_state = JaxExecutor(distribution).wrap_step(step)(state, batch)
    np.testing.assert_array_equal(logs["loss"], expected_logs["loss"])
    np.testing.assert_array_equal(new_state[0], expected_state[0])
    assert new_state[0].sharding == expected_state[0].sharding
