"""`python tensorflow_join_script.py OUT RAISING_RANK`: a TensorFlow join, and no training.

Started twice by a fake `srun` (`cluster_launchers.start_two`): imports
keras_parallel and Keras (the workers join), sums one value over both
workers' replicas, then `RAISING_RANK` raises while the other starts a
second sum, which fails once the raising worker is gone. Each prints one
JSON line after the first sum: its rank and the sum.
"""

import json
import os
import sys

import keras  # noqa: F401  (the join runs once Keras is imported)
import tensorflow as tf

import keras_parallel  # noqa: F401
from keras_parallel.backends.tensorflow import workers

strategy = workers.strategy()
rank = strategy.cluster_resolver.task_id


def total():
    """1 per replica, summed over every worker's replicas."""
    return float(strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), None))


line = {"rank": rank, "replicas": total()}
os.write(1, (json.dumps(line) + "\n").encode())  # One write: the ranks share it.
if rank == int(sys.argv[2]):
    raise RuntimeError(f"rank {rank} raises after the join")
total()
