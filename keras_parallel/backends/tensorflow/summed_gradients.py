"""The optimizer on gradients summed over replicas: clipped and accumulated whole."""

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

    Keras clips and accumulates each replica's part of the gradient, not
    the whole as one device does (weights 1e-2 off after 8 clipped steps),
    and the accumulation's `tf.cond` cannot hold the update's `merge_call`.
    Summed here first, the optimizer runs on the sum in each replica, its
    own all-reduce an identity (`summed_once`) and with no `merge_call`
    (`no_merge_call_on_summed`); the replicas' copies stay equal.
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
    """The optimizer's `_all_reduce_sum_gradients`, an identity on summed ones
    (see `gradients_summed_first`)."""

    def _all_reduce_sum_gradients(self, grads_and_vars):
        if getattr(_summed, "on", False):
            return list(grads_and_vars)
        return keras_all_reduce_sum_gradients(self, grads_and_vars)

    return _all_reduce_sum_gradients


def no_merge_call_on_summed(keras_use_merge_call):
    """A strategy's `_use_merge_call`, `False` while summed gradients are applied.

    `maybe_merge_call` and `strategy.extended.update` then run in the
    replica, on its own copy of each variable (`gradients_summed_first`).
    """

    def _use_merge_call(self):
        if getattr(_summed, "on", False):
            return False
        return keras_use_merge_call(self)

    return _use_merge_call
