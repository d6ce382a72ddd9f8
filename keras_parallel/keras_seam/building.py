"""Building an unbuilt model from a batch of its inputs, symbolically.

Keras builds some models only inside their first step: too late to plan them,
and on TensorFlow inside a replica step, where no variable can be made.
"""


def is_built(model):
    """Whether the model and every layer in it is built."""
    return model.built and all(
        layer.built for layer in model._flatten_layers(include_self=False)
    )


def build_from_inputs(model, inputs):
    """Builds `model`, if unbuilt, by calling it on symbolic tensors shaped
    like `inputs` (a nested batch of arrays or tensors); computes no value."""
    if is_built(model):
        return
    import keras

    def spec(value):
        shape = (None,) + tuple(value.shape)[1:]
        return keras.KerasTensor(shape, keras.backend.standardize_dtype(value.dtype))

    model(keras.tree.map_structure(spec, inputs))
