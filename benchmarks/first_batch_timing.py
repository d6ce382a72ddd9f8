"""Seconds from `fit`'s call to its first train batch (the `Auto` benchmarks).

Imports Keras only when called, so that each benchmark picks its backend
first.
"""

import time


def seconds_to_first_batch(model, x, y, batch_size=64):
    """Seconds from `model.fit`'s call to its first train batch's begin.

    One epoch of one step: what comes before the first step (planning,
    `Auto`'s choice, the data pipeline's start) and nothing after it.
    """
    import keras

    seen = []

    class First(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not seen:
                seen.append(time.perf_counter())

    start = time.perf_counter()
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=1,
        steps_per_epoch=1,
        verbose=0,
        callbacks=[First()],
    )
    return seen[0] - start
