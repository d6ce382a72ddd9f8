"""Seconds from `fit`'s call to its first train batch (the `Auto` benchmarks).

Imports Keras only when called, so that each benchmark picks its backend
first.
"""

import time


def seconds_to_first_batch(model, x, y, batch_size=64, with_step=False):
    """Seconds from `model.fit`'s call to its first train batch's begin.

    One epoch of one step: what comes before the first step (planning,
    `Auto`'s choice, the data pipeline's start) and nothing after it.

    Args:
        with_step: also return the first step's seconds (its compilation
            and its run), from the batch's begin to its end.
    """
    import keras

    seen = []

    class First(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not seen:
                seen.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            if len(seen) == 1:
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
    if with_step:
        return seen[0] - start, seen[1] - seen[0]
    return seen[0] - start
