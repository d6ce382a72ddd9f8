"""Methods of one model object replaced for a while, and put back.

Set on the instance, past Keras's and torch's attribute tracking, so that
only this model changes and its class stays as it was.
"""


def replace_methods(model, methods):
    """Sets `methods` (`{name: function}`) on `model` itself.

    Args:
        model: the object whose methods change.
        methods: the functions to call instead, by method name.

    Returns:
        A function that puts back what `model` had before.

    Example:

    >>> undo = replace_methods(model, {"save": lambda *a, **k: None})
    >>> undo()
    """
    saved = {name: model.__dict__.get(name) for name in methods}
    for name, function in methods.items():
        object.__setattr__(model, name, function)

    def undo():
        for name, value in saved.items():
            if value is None:
                model.__dict__.pop(name, None)
            else:
                object.__setattr__(model, name, value)

    return undo
