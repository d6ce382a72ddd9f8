"""Train the Keras guide's convnet on digits with plain `model.fit`, any backend.

The same script runs on every backend and device count:

    KERAS_BACKEND=jax python examples/train_digits.py
    KERAS_BACKEND=tensorflow python examples/train_digits.py
    KERAS_BACKEND=torch torchrun --nproc-per-node 2 examples/train_digits.py
    KERAS_BACKEND=torch keras-parallel launch --nproc 2 examples/train_digits.py

On JAX without an accelerator, set
`XLA_FLAGS=--xla_force_host_platform_device_count=8` first for 8 simulated
CPU devices.
"""

import keras

import keras_parallel
from keras_parallel import demo


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def main(epochs=30, batch_size=32):
    (x_train, y_train), (x_test, y_test) = demo.load_digits_28()
    keras.utils.set_random_seed(1)
    model = demo.get_model(Net)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        distribution=keras_parallel.DataParallel(),
    )
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=50, verbose=0)
    print(f"Test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
