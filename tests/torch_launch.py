"""`keras_parallel.launch` for the torch tests: ranks forked from a warm server.

A rank started with `spawn` is a fresh interpreter that imports torch, Keras
and the tests' helpers before its first line: about 4 CPU-seconds, most of
a small test's time on 2 cores. The tests' launches use the `forkserver`
start method instead (`launch(start_method=...)`, a documented option):
one server process imports those modules once, before it has run any
torch operation (no thread pool to fork), and every rank of every launch
is forked from it. What a rank then does (the torchrun environment, the
gloo group, the hard timeout, every child ended) is `launch`'s own, as with
`spawn`; tests/test_launcher.py checks `launch` with its default, `spawn`.

The server keeps the environment it started with: a test that must change
a rank's environment passes it through `launch`'s own options
(`collective_timeout`) or starts its ranks with `spawn`.
"""

import functools
import importlib.util
import multiprocessing

#: Imported once, in the server, for every rank forked from it. TensorFlow
#: too where it is installed: `keras.utils.set_random_seed`, which nearly
#: every rank calls, imports it then (about 3 CPU-seconds a rank; its import
#: starts no thread, so forking after it is as safe as after torch's).
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    *(["tensorflow"] if importlib.util.find_spec("tensorflow") else []),
    "keras",
    "keras_parallel",
    "keras_parallel.backends.torch",
    "keras_parallel.backends.torch.executor",
]


@functools.cache
def _preloading_forkserver():
    """The `forkserver` context, told once what its server imports."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def launch(fn, num_processes, args=(), **kwargs):
    """`keras_parallel.launch(fn, num_processes, args, **kwargs)`, forked ranks.

    Args:
        fn, num_processes, args, kwargs: as `keras_parallel.launch` takes
            them (`start_method` excepted).

    Returns:
        The values `fn` returned, ordered by rank.
    """
    from keras_parallel.launcher.torch_processes import launch as keras_launch

    _preloading_forkserver()
    return keras_launch(
        fn, num_processes, args=args, start_method="forkserver", **kwargs
    )
