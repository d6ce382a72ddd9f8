"""Methods of one model object replaced for a while, and put back.

Set on the instance, so that its class stays as it was.
"""

from keras_parallel.replacements import Replacements


def replace_methods(model, methods):
    """Sets `methods` (`{name: function}`, each name listed in a `REPLACED`
    table) on `model` itself; returns a function that puts back what it had."""
    replacements = Replacements()
    for name, function in methods.items():
        replacements.replace(model, name, function)
    return replacements.restore
