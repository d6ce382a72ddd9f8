"""A script's own `keras.distribution.initialize()`, after keras_parallel's.

keras_parallel may start `jax.distributed` when Keras is imported
(`runtime.py`), and JAX raises on a second `initialize`: Keras's is replaced
for good by one that accepts a call agreeing with the running runtime.
"""

from keras_parallel.backends.jax.keras_compat import distribution_lib
from keras_parallel.keras_seam.replacements import Replacements

# Never restored: the runtime lasts as long as the process.
_kept = Replacements()


def install():
    """Replaces Keras's JAX `initialize` by one that accepts a second call,
    once; returns the replacement."""
    current = distribution_lib.initialize
    if getattr(current, "_keras_parallel_once", False):
        return current

    def initialize(job_addresses=None, num_processes=None, process_id=None):
        import jax

        if not jax.distributed.is_initialized():
            return current(job_addresses, num_processes, process_id)
        running = {"num_processes": jax.process_count()}
        running["process_id"] = jax.process_index()
        asked = {"num_processes": num_processes, "process_id": process_id}
        wrong = {
            name: value
            for name, value in asked.items()
            if value is not None and int(value) != running[name]
        }
        if wrong:
            raise ValueError(
                "keras.distribution.initialize() asks for another runtime "
                "than the one keras_parallel started from the cluster's "
                f"variables. Received: {wrong}, running: {running}; remove "
                "the call (the runtime runs already) or fix its arguments."
            )
        return None

    initialize._keras_parallel_once = True
    _kept.replace(distribution_lib, "initialize", initialize)
    return initialize
