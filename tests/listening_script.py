"""A launched process that trains and, mid-`fit`, says so and waits.

The network tests list the sockets of a launch while every process waits
inside `fit`: its collectives and coordinator are up.
Usage: listening_script.py MARKER_DIRECTORY            (one launched process)
       listening_script.py MARKER_DIRECTORY launch     (`keras_parallel.launch`
                                                        of 2 torch processes)
"""

import os
import pathlib
import sys
import time


def train_and_wait(directory):
    import keras
    import numpy as np

    import keras_parallel

    class WaitInFit(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                (pathlib.Path(directory) / f"in_fit.{os.getpid()}").touch()
                time.sleep(float(os.environ.get("KP_WAIT_S", "6")))

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((64, 4), "float32")
    sharding = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    model.fit(x, x[:, :2], batch_size=16, verbose=0, callbacks=[sharding, WaitInFit()])


if __name__ == "__main__":
    if sys.argv[2:] == ["launch"]:
        import keras_parallel

        keras_parallel.launch(train_and_wait, 2, args=(sys.argv[1],), timeout=200)
    else:
        train_and_wait(sys.argv[1])
