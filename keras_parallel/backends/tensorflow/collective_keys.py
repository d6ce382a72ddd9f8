"""Collectives of a step Keras calls inside control flow, keyed when traced."""

import tensorflow as tf


def _key_fed_through_control_flow():
    """Whether a collective made now gets an instance key `tf.cond` drops.

    TensorFlow gives a collective traced in a `tf.function` an instance key
    fed when the function is called (`capture_call_time_value`), captured
    by the innermost function graph that is not a `tf.cond` or loop body.
    With `steps_per_execution > 1`, Keras's step function (a `tf.function`)
    is called inside a `tf.cond` of its `tf.while_loop`, which does not
    feed such an input: the step fails with "You must feed a value for
    placeholder tensor" (plain Keras under `MirroredStrategy` too).
    """
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    graph = getattr(graph, "outer_graph", None)  # Where it is called from.
    while graph is not None:
        if getattr(graph, "is_control_flow_graph", False):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def static_keys_in_control_flow(keras_use_unique_instance_key):
    """`CollectiveReplicaLauncher._use_unique_instance_key`, off where unfed.

    A collective of a function called inside control flow (see
    `_key_fed_through_control_flow`: the replica step, and the logs read
    across workers in the same function) takes its instance key when it is
    traced, as TensorFlow's graph mode does, instead of a key fed at each
    call that `tf.cond` cannot feed. The keys come from the same counter,
    so they never collide with fed ones; every worker traces the same step
    at the same point of its run, so they agree across workers.

    Args:
        keras_use_unique_instance_key: the method it replaces.

    Returns:
        The replacing method.
    """

    def _use_unique_instance_key(self):
        if _key_fed_through_control_flow():
            return False
        return keras_use_unique_instance_key(self)

    return _use_unique_instance_key
