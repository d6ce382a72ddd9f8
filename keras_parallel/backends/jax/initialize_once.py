"""A script's own `keras.distribution.initialize()`, after keras_parallel's.

Under a cluster's own launcher keras_parallel starts `jax.distributed` as
soon as Keras is imported (`runtime.py`). A script written for that
launcher may still call `keras.distribution.initialize()` itself, as
Keras's documentation asks, and JAX's `initialize` runs once per process:
a second call raises. So once keras_parallel has started the runtime,
Keras's JAX `initialize` is replaced, for the life of the process (the
runtime lasts as long), by one that accepts a call agreeing with the
running runtime (no arguments, or the same process count and id) and
refuses one that does not. A direct `jax.distributed.initialize()` is
JAX's own and still raises.
"""

from keras_parallel.backends.jax.keras_compat import distribution_lib
from keras_parallel.replacements import Replacements

# Never restored: the runtime keras_parallel started lasts as long.
_kept = Replacements()


def install():
    """Replaces Keras's JAX `initialize` by one that accepts a second call, once.

    Returns:
        The replacement.
    """
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
