"""TensorFlow across processes: one `MultiWorkerMirroredStrategy` from `TF_CONFIG`.

The strategy must exist before TensorFlow runs anything, so it is made once
Keras is imported, and the executor reuses it.
"""

import contextlib
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy

from keras_parallel import cluster_environments
from keras_parallel.backends.tensorflow import DEVICES_ENV, strategies
from keras_parallel.backends.tensorflow import devices as tf_devices
from keras_parallel.cluster_environments import join_deadline, tf_config
from keras_parallel.input import kinds
from keras_parallel.keras_seam.keras_compat import print_msg
from keras_parallel.keras_seam.replacements import replaced
from keras_parallel.messages.signed_store import KeyAlreadySetError

_strategy = None

# Old names: `tf_config` reads them without TensorFlow, for the import hook.
cluster_workers = tf_config.cluster_workers
wanted = tf_config.wanted


def fill_tf_config(environ=None):
    """Sets `TF_CONFIG` in `environ` (default `os.environ`) from the cluster
    environment (`srun`, `mpirun`) where it is unset; returns the names set.

    Raises:
        ClusterEnvironmentError: a variable of the environment is wrong, or
            it does not name every worker's host.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TF_CONFIG", "").strip():
        return []
    env = cluster_environments.detect_cluster_environment(environ)
    if env is None or env.world_size() <= 1:
        return []
    environ.update(cluster_environments.environment_variables(env, "tensorflow"))
    return ["TF_CONFIG"]


def strategy():
    """The process's multi-worker strategy, or `None` in one process."""
    return _strategy


def initialize_from_environment():
    """Creates the multi-worker strategy `TF_CONFIG` asks for, once.

    Call it before TensorFlow runs anything. Returns the strategy, or
    `None` for one worker (whose CPU is still split as `DEVICES_ENV` asks).

    Raises:
        RuntimeError: TensorFlow already started in this process.
        ClusterEnvironmentError: a variable of the cluster environment is
            wrong, or this worker's port is taken.
    """
    global _strategy
    filled = fill_tf_config() if _strategy is None else []
    count = os.environ.get(DEVICES_ENV)
    if _strategy is not None or not wanted():
        if count and _strategy is None and not tf.config.list_physical_devices("GPU"):
            tf_devices.split_cpu(int(count))  # One worker: a local strategy.
        return _strategy
    try:
        if count and not tf.config.list_physical_devices("GPU"):
            # Not `split_cpu`: listing the devices would start the runtime.
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * int(count)
            )
        with _bounded_join(filled):
            _strategy = ExactMultiWorkerMirroredStrategy()
    except cluster_environments.ClusterEnvironmentError:
        raise  # It names the variable to fix: not TensorFlow's start.
    except (RuntimeError, ValueError) as error:
        raise RuntimeError(
            "Cannot start TensorFlow across processes: the strategy must be "
            "made before TensorFlow runs anything. Received: TF_CONFIG with "
            f"{len(cluster_workers()[0])} workers and {error}; import "
            "keras_parallel before the script's first TensorFlow work (it "
            "makes the strategy once Keras is imported), or start the script "
            "with `keras-parallel launch --backend tensorflow` or "
            "`python -m keras_parallel.launcher.bootstrap train.py`."
        ) from error
    return _strategy


@contextlib.contextmanager
def _bounded_join(filled):
    """Checks this worker's port, then bounds the wait for the others; the
    messages name the launcher's variables where `filled`, else `TF_CONFIG`."""
    workers = tf_config.TFConfigEnvironment()
    index = workers.global_rank()  # An index out of the list fails here.
    addresses = workers.worker_addresses()
    if filled:
        env = cluster_environments.detect_cluster_environment().validate()
    else:
        env = workers
    with join_deadline.port_checked(env, addresses[index]):
        with join_deadline.join_deadline(env, addresses[0]):
            yield


class ExactMultiWorkerMirroredStrategy(
    strategies.ExactRun, tf.distribute.MultiWorkerMirroredStrategy
):
    """A `MultiWorkerMirroredStrategy` whose replicas know their share.

    Its replicas are each worker's GPUs, else all its logical CPU devices
    (TensorFlow's own takes one).
    """

    def __init__(self):
        extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
        local_devices = _every_cpu_device(extended._initialize_local_devices)
        with replaced({(extended, "_initialize_local_devices"): local_devices}):
            super().__init__()

    @property
    def num_workers(self):
        return self.extended._num_workers

    @property
    def worker_index(self):
        return self.extended._task_id

    def global_devices(self):
        """Every replica's device, worker by worker: `["worker0/cpu:0", ...]`."""
        local = [tf_devices.normalize(d) for d in self.extended.worker_devices]
        return [f"worker{w}/{d}" for w in range(self.num_workers) for d in local]


def _every_cpu_device(keras_local_devices):
    def local_devices(self, cluster_resolver, worker_device):
        devices, kind = keras_local_devices(self, cluster_resolver, worker_device)
        if kind == "CPU":
            cpu = tf.config.list_physical_devices("CPU")[0]
            count = len(tf.config.get_logical_device_configuration(cpu) or [None])
            devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(count))
        return devices, kind

    return local_devices


def worker_of(device):
    """The worker index in a device name `"worker<i>/<type>:<n>"`, else 0."""
    head, _, rest = str(device).partition("/")
    if rest and head.startswith("worker") and head[6:].isdigit():
        return int(head[6:])
    return 0


def sum_over_workers(strategy, value, src=None):
    """The sum over workers of `value`, in float64 NumPy: one all-reduce.

    Only worker `src` contributes where given (a broadcast). Exact for
    integers below 2**24: values travel as float32, which every device's
    all-reduce supports.
    """
    value = np.asarray(value, np.float32)
    zeros = np.zeros_like(value)
    per_worker = strategy.num_replicas_in_sync // strategy.num_workers

    def value_fn(context):
        replica = context.replica_id_in_sync_group
        worker, first = divmod(replica, per_worker)
        contributes = first == 0 and (src is None or worker == src)
        return tf.constant(value if contributes else zeros)

    with strategy.scope():
        values = strategy.experimental_distribute_values_from_function(value_fn)
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)
    return np.asarray(total.numpy(), np.float64)


def broadcast_bytes(strategy, payload, src=0):
    """Worker `src`'s `payload` (bytes) on every worker: two all-reduces,
    of the length, then of the bytes."""
    is_source = strategy.worker_index == src
    length = int(sum_over_workers(strategy, len(payload) if is_source else 0, src))
    buffer = np.zeros(length, np.uint8)
    if is_source:
        buffer[:] = np.frombuffer(payload, np.uint8)
    data = sum_over_workers(strategy, buffer, src).round().astype(np.uint8)
    return data.tobytes()


class CoordinationStore:
    """The workers' key-value store: TensorFlow's coordination service,
    which `MultiWorkerMirroredStrategy` starts."""

    #: A read waits this long for a key not written yet (TensorFlow has no
    #: read that returns at once; 0 would wait for ever).
    READ_WAIT_MS = 1

    def set(self, key, value):
        """Writes `value` under `key`, which must hold nothing or `value`.

        The service keeps a key's first value: a write that finds another
        one there would be lost without a word (a value someone else wrote
        first, under a key they guessed). Writing the same value again is
        no error.

        Raises:
            KeyAlreadySetError: `key` holds another value.
        """
        from tensorflow.python.eager import context

        try:
            context.context().set_config_key_value(key, value)
        except tf.errors.AlreadyExistsError:
            found = self.try_get(key)
            if found == value:
                return
            raise KeyAlreadySetError(
                f"the run's store already holds another value under {key!r}, "
                "which keeps a key's first value. Received: a write of "
                f"{len(value)} characters where {len(found or '')} are; "
                "every process of the run must share its secret, and nothing "
                'else may write to its store (docs/multihost.md, "Network and '
                'trust").'
            ) from None

    def try_get(self, key):
        from tensorflow.python.eager import context

        try:
            return context.context().get_config_key_value(key, self.READ_WAIT_MS)
        except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError):
            return None

    def delete(self, key):
        """Forgets `key`, once read (the store keeps all else)."""
        from tensorflow.python.eager import context

        context.context().delete_config_key_value(key)


def _numpy_shuffle(value, seed=None, name=None):
    """`tf.random.shuffle` drawn from NumPy's global state (see `numpy_shuffles`)."""

    def permute(array):
        return np.random.permutation(array.numpy())

    out = tf.py_function(permute, [value], value.dtype)
    out.set_shape(value.shape)
    return out


@contextlib.contextmanager
def numpy_shuffles(adapter_class):
    """Keras's array data set shuffles with NumPy while this scope is entered.

    Keras draws each epoch's permutation with `tf.random.shuffle`, whose
    state no two processes share; from NumPy's shared state every worker
    draws the same one.

    Args:
        adapter_class: Keras's `ArrayDataAdapter`.
    """
    keras_get_tf_dataset = adapter_class.get_tf_dataset

    def get_tf_dataset(self):
        with replaced({(tf.random, "shuffle"): _numpy_shuffle}):
            return keras_get_tf_dataset(self)

    with replaced({(adapter_class, "get_tf_dataset"): get_tf_dataset}):
        yield


_INPUTS_SAID = set()


def say_input(adapter, divided=False):
    """Worker 0 says, once per kind of input, how the workers read it.

    Args:
        adapter: Keras's data adapter.
        divided: whether each worker prepares only its share
            (`divided_input`), rather than reading it whole.
    """
    strategy = _strategy
    if strategy is None or adapter is None:
        return
    kind = kinds.input_kind(adapter)
    if kind in _INPUTS_SAID or strategy.num_workers <= 1:
        return
    _INPUTS_SAID.add(kind)
    if strategy.worker_index == 0:
        how = "each worker taking its rows of the others' batches"
        print_msg(kinds.input_line(kind, divided, strategy.num_workers, how=how))
