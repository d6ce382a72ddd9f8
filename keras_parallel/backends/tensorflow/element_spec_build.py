"""The model built from the data set's element spec: no batch drawn, none lost."""

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from keras_parallel.backends.tensorflow import variables as tf_variables
from keras_parallel.backends.tensorflow import workers as tf_workers
from keras_parallel.backends.tensorflow.keras_compat import DATA_ADAPTERS, tree
from keras_parallel.backends.tensorflow.strategies import ExactRun
from keras_parallel.keras_seam.building import build_from_inputs, is_built


def built_from_element_spec(keras_maybe_symbolic_build):
    """Keras's `_maybe_symbolic_build`, drawing no batch.

    Under a strategy Keras builds from a batch of a fresh iterator: that
    iterator's prefetch consumes a generator (4 batches of 64 trained as
    2), and replicas' batches of different sizes (11/11/11/10) fail to
    average. The build needs only the data set's element spec.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not isinstance(strategy, ExactRun):
            return keras_maybe_symbolic_build(self, iterator, data_batch)
        _build_from_element_spec(self, strategy, iterator._distributed_dataset)

    return _maybe_symbolic_build


def late_distribution(model):
    """Keras's `TFEpochIterator._get_iterator`, distributing late if need be.

    Keras distributes the data and builds under the strategy when `fit`
    starts; a `ShardingCallback` applies it just after (`set_model`), so its
    first run does both here, before any step is traced.
    """

    def _get_iterator(self):
        adapter = getattr(self, "data_adapter", None)
        dataset = self._distributed_dataset
        strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, ExactRun):
            return dataset
        if not isinstance(dataset, tf.distribute.DistributedDataset):
            if tf_workers.strategy() is not None and isinstance(adapter, DATA_ADAPTERS):
                # Made before the scope: remade, divided between workers.
                dataset = adapter.get_tf_dataset()
            dataset = strategy.experimental_distribute_dataset(dataset)
            self._distributed_dataset = dataset
            _build_from_element_spec(model, strategy, dataset)
        elif not is_built(model):
            # `predict` of an unbuilt model: Keras would build it inside the
            # replica step, where no variable can be made.
            _build_from_element_spec(model, strategy, dataset)
        tf_workers.say_input(adapter)  # Once per kind; a divided one said so.
        return dataset

    return _get_iterator


def _symbolic_spec(spec):
    """One replica's spec of a batch element; `None` for an absent one
    (Keras's empty `Optional`)."""
    if isinstance(spec, values_lib.PerReplicaSpec):
        spec = spec._component_specs[0]
    if isinstance(spec, tf.OptionalSpec):
        return None
    return spec


def _build_from_element_spec(model, strategy, dataset):
    """Builds the model, loss, metrics and optimizer from `dataset`'s element
    spec (plain or distributed), drawing nothing from it."""
    batch = tree.map_structure(_symbolic_spec, dataset.element_spec)
    if not isinstance(batch, (tuple, list)):
        batch = (batch,)
    with strategy.scope():
        if len(batch) < 2:
            # A predict batch (its inputs only): no loss or metric to build.
            build_from_inputs(model, batch[0])
        else:
            model._symbolic_build(data_batch=batch)
    # A metric given as an object made plain variables in its `__init__`,
    # which one worker's replicas would share: moved like the model's.
    tf_variables.move_variables(model, strategy)
