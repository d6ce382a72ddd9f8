"""`python cluster_join_script.py OUT ORDER [RAISING_RANK]`: a join, and no training.

Started twice by a fake `srun` (`cluster_launchers.start_two`): imports
keras_parallel and Keras in `ORDER` (`keras_parallel_first` or
`keras_first`), then runs one collective over both processes and prints
one JSON line: the process count, the devices, and whether the join marked
this process. With `RAISING_RANK`, that rank raises after a second
collective while the other starts a third, which can only end if the
raising process ends: the test that a failing rank does not linger.

The collective the other waits in has run before, as a `fit` step has after
its first batch: its connections are made, and it fails as soon as the
raising process exits. A collective whose connections are still being made
when a process dies waits instead for JAX's heartbeat timeout (100 s), then
aborts (seen here in 5 of 30 runs on a loaded machine when the raising rank
left after the first collective).
"""

import importlib
import json
import os
import sys

#: The imports, in the order the test names (a plain `import` block would
#: be sorted by the linter): keras_parallel first, its hook waits for Keras;
#: Keras first, the hook runs when keras_parallel is imported.
ORDERS = {
    "keras_parallel_first": ("keras_parallel", "keras"),
    "keras_first": ("keras", "keras_parallel"),
}
for name in ORDERS[sys.argv[2]]:
    importlib.import_module(name)

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

rank = jax.process_index()
multihost_utils.sync_global_devices("joined")
line = {
    "rank": rank,
    "processes": jax.process_count(),
    "devices": jax.device_count(),
    "marked": os.environ.get("KERAS_PARALLEL_JOINED_PID") == str(os.getpid()),
}
os.write(1, (json.dumps(line) + "\n").encode())  # One write: the ranks share it.
multihost_utils.sync_global_devices("joined again")
if len(sys.argv) > 3 and rank == int(sys.argv[3]):
    raise RuntimeError(f"rank {rank} raises after the join")
multihost_utils.sync_global_devices("after")
