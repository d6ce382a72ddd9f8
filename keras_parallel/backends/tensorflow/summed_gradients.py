"""The optimizer on gradients summed over the replicas: clipped and accumulated whole."""

import threading

import tensorflow as tf

from keras_parallel.backends.tensorflow.strategies import ExactRun

# Set while a replica applies gradients already summed over the replicas.
_summed = threading.local()


def _in_exact_replica():
    return (
        tf.distribute.has_strategy()
        and not tf.distribute.in_cross_replica_context()
        and isinstance(tf.distribute.get_strategy(), ExactRun)
    )


def gradients_summed_first(keras_backend_apply_gradients):
    """The optimizer's `_backend_apply_gradients`, on the replicas' summed gradients.

    Keras's optimizer clips (`clipnorm`, `global_clipnorm`, `clipvalue`)
    and accumulates (`gradient_accumulation_steps`) in each replica, on that
    replica's part of the gradient, and sums the parts only when it updates
    the variables. One device clips and accumulates the whole gradient
    (measured: weights 1e-2 off after 8 clipped steps), and the
    accumulation's `tf.cond` cannot hold the update's `merge_call`
    ("merge_call called while defining a new graph"). In a replica of an
    exact strategy the gradients are summed here first, with the one
    all-reduce Keras makes at the update, and Keras's optimizer then runs
    on the sum in each replica, as it does on one device: its own
    all-reduce is then an identity (`summed_once`), and it updates each
    replica's copy of every variable in the replica, without `merge_call`
    (`no_merge_call_on_summed`), as Keras does under XLA on GPUs. Every
    replica applies the same sum to the same values, so the copies stay
    equal.

    Args:
        keras_backend_apply_gradients: the method it replaces.

    Returns:
        The replacing method.
    """

    def _backend_apply_gradients(self, grads, trainable_variables):
        if getattr(_summed, "on", False) or not _in_exact_replica():
            return keras_backend_apply_gradients(self, grads, trainable_variables)
        context = tf.distribute.get_replica_context()
        grads = context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
        _summed.on = True
        try:
            return keras_backend_apply_gradients(self, grads, trainable_variables)
        finally:
            _summed.on = False

    return _backend_apply_gradients


def summed_once(keras_all_reduce_sum_gradients):
    """The optimizer's `_all_reduce_sum_gradients`, an identity on summed ones.

    Args:
        keras_all_reduce_sum_gradients: the method it replaces.

    Returns:
        The replacing method (see `gradients_summed_first`).
    """

    def _all_reduce_sum_gradients(self, grads_and_vars):
        if getattr(_summed, "on", False):
            return list(grads_and_vars)
        return keras_all_reduce_sum_gradients(self, grads_and_vars)

    return _all_reduce_sum_gradients


def no_merge_call_on_summed(keras_use_merge_call):
    """A strategy's `_use_merge_call`, `False` while summed gradients are applied.

    `tf.__internal__.distribute.interim.maybe_merge_call` and
    `strategy.extended.update` then run in the replica, on its own copy of
    each variable (see `gradients_summed_first`); elsewhere nothing changes.

    Args:
        keras_use_merge_call: the method it replaces.

    Returns:
        The replacing method.
    """

    def _use_merge_call(self):
        if getattr(_summed, "on", False):
            return False
        return keras_use_merge_call(self)

    return _use_merge_call
