"""Collectives of a step Keras calls inside control flow, keyed when traced."""

import tensorflow as tf


def _key_fed_through_control_flow():
    """Whether a collective made now gets an instance key `tf.cond` drops.

    A collective's instance key is fed at call time, which a `tf.cond`
    does not do: with `steps_per_execution > 1` Keras calls its step inside
    one, and the step fails with "You must feed a value for placeholder
    tensor" (plain Keras under `MirroredStrategy` too).
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

    A collective called inside control flow takes its key when traced, as
    in graph mode. The keys come from the same counter as fed ones, and
    every worker traces the same step at the same point, so they agree.
    """

    def _use_unique_instance_key(self):
        if _key_fed_through_control_flow():
            return False
        return keras_use_unique_instance_key(self)

    return _use_unique_instance_key
