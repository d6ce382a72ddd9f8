"""The Keras guide's convnet learns the digits under DataParallel on TensorFlow."""

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow executor tests run in the tensorflow tox env",
)

if keras.backend.backend() == "tensorflow":
    import tf_devices  # conftest split the CPU into logical devices

import keras_parallel  # noqa: E402
from keras_parallel import demo  # noqa: E402

# The demo trains 30 epochs at batch 32 (about 94% on one device). Fewer
# epochs keep this test short on a 2-core machine; the test accuracy lags
# the training accuracy until the BatchNormalization moving statistics settle.
EPOCHS = 20
BATCH_SIZE = 32


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


@pytest.mark.slow
def test_guide_convnet_reaches_90_percent_on_digits():
    keras.utils.set_random_seed(1)
    (x_train, y_train), (x_test, y_test) = demo.load_digits_28()
    model = demo.get_model(Net)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        distribution=keras_parallel.DataParallel(devices=tf_devices.devices(2)),
    )
    history = model.fit(
        x_train, y_train, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=0
    )
    # 449 test samples at batch 50: the last batch (49) gives both devices
    # samples. (A batch smaller than the device count leaves a replica an
    # empty batch, which TensorFlow's oneDNN Conv2D mis-shapes; see
    # docs/tensorflow.md.)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=50, verbose=0)
    print("accuracy per epoch:", [round(a, 3) for a in history.history["accuracy"]])
    print("test accuracy:", accuracy)
    assert accuracy >= 0.90
