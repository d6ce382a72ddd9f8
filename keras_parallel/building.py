"""Building an unbuilt model from a batch of its inputs, symbolically.

Keras builds some models only inside their first step (torch's `predict`,
TensorFlow's `predict_on_batch` and, under a strategy, `predict`), after
the step function was made: too late to plan them, and on TensorFlow inside
a replica step, where no variable can be made. keras_parallel builds them
first, from the batch's shapes; no value is computed.
"""


def is_built(model):
    """Whether the model and every layer in it is built."""
    return model.built and all(
        layer.built for layer in model._flatten_layers(include_self=False)
    )


def build_from_inputs(model, inputs):
    """Builds `model` by calling it on symbolic tensors shaped like `inputs`.

    Args:
        model: a `keras.Model`; nothing happens if it is built.
        inputs: a batch of the model's inputs (arrays or tensors, nested).
    """
    if is_built(model):
        return
    import keras

    def spec(value):
        shape = (None,) + tuple(value.shape)[1:]
        return keras.KerasTensor(shape, keras.backend.standardize_dtype(value.dtype))

    model(keras.tree.map_structure(spec, inputs))
