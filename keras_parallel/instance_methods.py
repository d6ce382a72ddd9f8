"""Methods of one model object replaced for a while, and put back.

Set on the instance (through `keras_parallel.replacements`), so that only
this model changes and its class stays as it was.
"""

from keras_parallel.replacements import Replacements


def replace_methods(model, methods):
    """Sets `methods` (`{name: function}`) on `model` itself.

    Args:
        model: the object whose methods change.
        methods: the functions to call instead, by method name (each listed
            in a `REPLACED` table).

    Returns:
        A function that puts back what `model` had before.

    Example:

    >>> undo = replace_methods(model, {"save": lambda *a, **k: None})
    >>> undo()
    """
    replacements = Replacements()
    for name, function in methods.items():
        replacements.replace(model, name, function)
    return replacements.restore
