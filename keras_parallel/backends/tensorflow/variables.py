"""Moving an existing Keras model's state into (and out of) a tf.distribute strategy.

A strategy mirrors only variables made under its scope, so each Keras
variable's `tf.Variable` is re-created there and swapped in.
"""

import tensorflow as tf

_ON_READ = tf.VariableSynchronization.ON_READ


def all_variables(model):
    """Every Keras variable of the model, its optimizer and its metrics
    (seed generators' states too), once each, in a stable order."""
    groups = [model.variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        groups.append(optimizer.variables)
    groups.append(getattr(model, "metrics_variables", []))
    seen = set()
    out = []
    for group in groups:
        for variable in group:
            if id(variable) not in seen and hasattr(variable, "_value"):
                seen.add(id(variable))
                out.append(variable)
    return out


def is_distributed_by(variable, strategy):
    """Whether a Keras variable's `tf.Variable` already belongs to `strategy`."""
    value = getattr(variable, "_value", None)
    return getattr(value, "_distribute_strategy", None) is strategy


def move_variables(model, strategy=None):
    """Re-creates the model's variables under `strategy`, keeping their values.

    Args:
        model: a built `keras.Model`.
        strategy: a `tf.distribute.Strategy`, or `None` to bring the
            variables back to plain one-device `tf.Variable`s.

    Returns:
        How many variables were moved.
    """
    variables = [v for v in all_variables(model) if v._value is not None]
    if strategy is not None:
        variables = [v for v in variables if not is_distributed_by(v, strategy)]
    else:
        variables = [v for v in variables if _is_distributed(v._value)]
    if not variables:
        return 0
    optimizers = _optimizers_of(model)
    old_keys = {id(v): [(o, o._var_key(v)) for o in optimizers] for v in variables}
    # All created before any swap: a failure leaves the old variables.
    created = [_recreate(v, strategy) for v in variables]
    for variable, new in zip(variables, created, strict=True):
        variable._value = new
    # The optimizer keys its state by the `tf.Variable`'s id, now changed.
    for variable in variables:
        for optimizer, old_key in old_keys[id(variable)]:
            _rekey(optimizer, old_key, optimizer._var_key(variable))
    return len(variables)


def _is_distributed(value):
    return isinstance(value, tf.distribute.DistributedValues)


def _read(value):
    """The value of a (possibly distributed) `tf.Variable`, as one tensor."""
    if _is_distributed(value):
        # In its strategy's scope an on-read variable reads its aggregate.
        with value.distribute_strategy.scope():
            return tf.convert_to_tensor(value.read_value())
    return tf.convert_to_tensor(value.read_value())


def _recreate(variable, strategy):
    old = variable._value
    value = _read(old)
    kwargs = dict(
        dtype=old.dtype,
        trainable=variable.trainable,
        name=variable.name,
        aggregation=variable._map_aggregation(variable.aggregation),
        synchronization=variable._map_synchronization(variable.synchronization),
    )
    if strategy is None:
        with tf.init_scope():
            return tf.Variable(value, **kwargs)
    with strategy.scope(), tf.init_scope():
        new = tf.Variable(value, **kwargs)
        if old.synchronization == _ON_READ or kwargs["synchronization"] == _ON_READ:
            # Each replica starts with the initial value, so a SUM variable
            # would read `num_replicas` times too large; assigning in
            # cross-replica context splits it right.
            new.assign(value)
    return new


def _optimizers_of(model):
    """The model's optimizer and the optimizers it wraps (loss scaling)."""
    found = []
    stack = [getattr(model, "optimizer", None)]
    while stack:
        optimizer = stack.pop()
        if optimizer is None or any(optimizer is o for o in found):
            continue
        if not hasattr(optimizer, "_var_key"):
            continue
        found.append(optimizer)
        stack.append(getattr(optimizer, "inner_optimizer", None))
        stack.extend(getattr(optimizer, "optimizers", None) or [])
    return found


def _rekey(optimizer, old_key, new_key):
    if old_key == new_key:
        return
    for name in ("_trainable_variables_indices", "_var_to_optimizer_idx"):
        table = getattr(optimizer, name, None)
        if isinstance(table, dict) and old_key in table:
            table[new_key] = table.pop(old_key)
