"""The model built from the data set's element spec: no batch drawn (a generator loses none)."""

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from keras_parallel.backends.tensorflow import variables as tf_variables
from keras_parallel.backends.tensorflow import workers as tf_workers
from keras_parallel.backends.tensorflow.keras_compat import DATA_ADAPTERS, tree
from keras_parallel.backends.tensorflow.strategies import ExactRun
from keras_parallel.building import build_from_inputs, is_built


def built_from_element_spec(keras_maybe_symbolic_build):
    """Keras's `_maybe_symbolic_build`, drawing no batch.

    Under a strategy, Keras builds the model (and its loss, metrics and
    optimizer) from a first batch it draws from a new iterator of the data
    set, then starts the epoch on another. A Python generator is not
    replayed: that first iterator's prefetch consumes it, and the epoch sees
    only the two batches Keras peeked (4 batches of 64 trained as 2). And
    Keras averages the replicas' first batches, which fails when they differ
    in size (43 samples over 4 replicas: 11/11/11/10). Only shapes and
    dtypes matter for the build, so it is built from the data set's element
    spec (what one device traces its step with): no batch is drawn.

    Args:
        keras_maybe_symbolic_build: the method it replaces.

    Returns:
        The replacing `_maybe_symbolic_build`.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not isinstance(strategy, ExactRun):
            return keras_maybe_symbolic_build(self, iterator, data_batch)
        _build_from_element_spec(self, strategy, iterator._distributed_dataset)

    return _maybe_symbolic_build


def model_built_from_element_spec(model):
    """`model._maybe_symbolic_build` while a plan is applied: drawing no batch.

    Through `ShardingCallback`, a run after the first starts with the
    strategy still attached but outside `patched` (entered at `set_model`,
    after Keras built): Keras's own build would draw a batch (see
    `built_from_element_spec`). Set on the model itself, it holds for
    every run until the plan is released.

    Args:
        model: the Keras model.

    Returns:
        The function to set as the model's `_maybe_symbolic_build`.
    """

    def _maybe_symbolic_build(iterator=None, data_batch=None):
        keras_method = type(model)._maybe_symbolic_build
        return built_from_element_spec(keras_method)(model, iterator, data_batch)

    return _maybe_symbolic_build


def late_distribution(model):
    """Keras's `TFEpochIterator._get_iterator`, distributing late if need be.

    Keras distributes the data set, and builds the optimizer and metrics
    under the strategy, when `fit` starts, with the model's strategy at that
    moment. A `ShardingCallback` applies the strategy just after (at
    `set_model`), so on the first run both are done here, when the epoch
    starts and before any step is traced: the batches are split, and no
    variable is created inside a traced replica step.
    """

    def _get_iterator(self):
        adapter = getattr(self, "data_adapter", None)
        dataset = self._distributed_dataset
        strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, ExactRun):
            return dataset
        if not isinstance(dataset, tf.distribute.DistributedDataset):
            if tf_workers.strategy() is not None and isinstance(adapter, DATA_ADAPTERS):
                # Made before the scope: made again, divided between the
                # workers (`divided_input`; nothing was drawn from it).
                dataset = adapter.get_tf_dataset()
            dataset = strategy.experimental_distribute_dataset(dataset)
            self._distributed_dataset = dataset
            _build_from_element_spec(model, strategy, dataset)
        elif not is_built(model):
            # `predict` of an unbuilt model: Keras would build it inside the
            # traced replica step, where no variable can be made.
            _build_from_element_spec(model, strategy, dataset)
        tf_workers.say_input(adapter)  # Once per kind; a divided one said so.
        return dataset

    return _get_iterator


def _symbolic_spec(spec):
    """One replica's spec of a batch element; `None` for an absent one.

    A distributed data set over several local replicas gives a
    `PerReplicaSpec`, whose replicas' specs differ only in device; Keras
    feeds an absent value (no sample weights) as an empty `Optional`.
    """
    if isinstance(spec, values_lib.PerReplicaSpec):
        spec = spec._component_specs[0]
    if isinstance(spec, tf.OptionalSpec):
        return None
    return spec


def _build_from_element_spec(model, strategy, dataset):
    """Builds the model, loss, metrics and optimizer from the data's shapes.

    Nothing is drawn from `dataset` (a generator's batches are not lost).

    Args:
        model: the Keras model.
        strategy: the exact strategy it runs under.
        dataset: a `tf.data.Dataset` or a distributed one (its
            `element_spec`: batch dimension `None`, as one device traces).
    """
    batch = tree.map_structure(_symbolic_spec, dataset.element_spec)
    if not isinstance(batch, (tuple, list)):
        batch = (batch,)
    with strategy.scope():
        if len(batch) < 2:
            # A predict batch (its inputs only): no loss or metric to build.
            build_from_inputs(model, batch[0])
        else:
            model._symbolic_build(data_batch=batch)
    # The compiled metrics are built now, under the strategy: those Keras
    # makes (`"accuracy"`) are born on-read, but a metric given as an
    # object made its variables in its `__init__`, as plain variables the
    # replicas of one worker would share (its History value that worker's
    # alone). They are moved under the strategy like the model's.
    tf_variables.move_variables(model, strategy)
