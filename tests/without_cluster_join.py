"""`python without_cluster_join.py script.py [args]`: the script, unjoined.

Runs the script as it would run if keras_parallel did not join a cluster's
processes once Keras is imported (`keras_parallel._join_cluster`) nor, on
torch, fill the process group's variables from the cluster's
(`group.fill_from_cluster_environment`): the cluster tests' red case, which
must fail their checks, not pass or hang.
"""

import os
import runpy
import sys

import keras_parallel

assert "keras" not in sys.modules, "Keras must not be imported yet"
sys.meta_path[:] = [
    finder
    for finder in sys.meta_path
    if getattr(finder, "callback", None) is not keras_parallel._join_cluster
]
if os.environ.get("KERAS_BACKEND") == "torch":
    from keras_parallel.backends.torch import group

    group.fill_from_cluster_environment = lambda environ=None: []
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
