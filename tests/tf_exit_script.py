"""A process that exits while a `tf.data` iterator, left in a reference
cycle, is reading a generator in its own thread (as a preempted worker's
Keras iterator is).

`python tf_exit_script.py divided` first makes a TensorFlow
`DividedInput`, as a worker dividing its input does; `plain` does not.
At the interpreter's final collection the reading thread can no longer run
Python, and deleting the iterator waits for it: `plain` hangs (checked by
hand: killed after 40 s), `divided` collects the cycle before exit.
"""

import sys
import time

import tensorflow as tf


class TwoWorkers:
    num_workers, worker_index, num_replicas_in_sync = 2, 0, 2


if sys.argv[1] == "divided":
    from keras_parallel.backends.tensorflow.divided_input import DividedInput

    DividedInput(TwoWorkers(), store=None)


def slow():
    while True:
        time.sleep(1.0)  # Still drawing when the process exits.
        yield 1


dataset = tf.data.Dataset.from_generator(
    slow, output_signature=tf.TensorSpec((), tf.int32)
).prefetch(4)
iterator = iter(dataset)
next(iterator)
cycle = [iterator]
cycle.append(cycle)  # Freed only by a collection, as Keras's iterator was.
del iterator, cycle
print("exiting", flush=True)
