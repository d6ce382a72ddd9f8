"""The one place keras_parallel sees each run's `CallbackList`.

Keras calls `CallbackList.set_params` once every callback has its model, after
both doors are entered and before any hook: a handler added here gets each
list then, to remove, read or append callbacks.
"""

import weakref

from keras.callbacks import Callback, CallbackList

from keras_parallel.keras_seam.replacements import Replacements

_handlers = []
_replacements = Replacements()
#: The last list made while a handler was registered (a weak reference).
_latest = [None]
#: `{callback list: the callbacks remove_callbacks took out of it}`.
_removed = weakref.WeakKeyDictionary()


def add_handler(handler, model=None):
    """Calls `handler(callback_list)` for each list Keras makes from now on.

    Args:
        handler: a function of the finished `CallbackList`; handlers run in
            the order added.
        model: if a run of `model` is under way (a plan applied inside
            `fit`), `handler` is also called now on that run's list.

    Returns:
        A function that removes the handler (safe to call twice).
    """
    entry = [handler]  # A list, so two registrations of one handler stay two.
    if not _handlers:
        _replacements.replace(CallbackList, "set_params", _set_params)
    _handlers.append(entry)
    latest = _latest[0] and _latest[0]()
    if model is not None and latest is not None and latest.model is model:
        handler(latest)

    def remove():
        if any(e is entry for e in _handlers):
            _handlers[:] = [e for e in _handlers if e is not entry]
            if not _handlers:
                _replacements.restore()
                _latest[0] = None

    return remove


_keras_set_params = CallbackList.set_params


def _set_params(callback_list, params):
    _keras_set_params(callback_list, params)
    _latest[0] = weakref.ref(callback_list)
    for (handler,) in list(_handlers):
        handler(callback_list)


def remove_callbacks(callback_list, kinds):
    """Takes the callbacks of `kinds` (a class or tuple) out of `callback_list`.

    They stay listed for handlers that must decide from the whole list,
    alike on every process (`every_callback`).
    """
    kept = [c for c in callback_list.callbacks if not isinstance(c, kinds)]
    removed = [c for c in callback_list.callbacks if isinstance(c, kinds)]
    callback_list.callbacks = kept
    _removed[callback_list] = _removed.get(callback_list, []) + removed


def every_callback(callback_list):
    """The run's callbacks, those `remove_callbacks` took out included."""
    return list(callback_list.callbacks) + list(_removed.get(callback_list, ()))


def append_callback(callback_list, callback):
    """Adds `callback` last to `callback_list`, with its model and params."""
    callback.set_model(callback_list.model)
    callback.set_params(callback_list.params)
    callback_list.callbacks.append(callback)


class PhaseCallback(Callback):
    """Calls `on_begin(phase)` and `on_end(phase)` (functions or None) as a
    `"train"`, `"test"` or `"predict"` run begins and ends."""

    async_safe = True  # No batch hook: Keras may dispatch the others async.

    def __init__(self, on_begin=None, on_end=None):
        super().__init__()
        self._on_begin = on_begin or _nothing
        self._on_end = on_end or _nothing

    def on_train_begin(self, logs=None):
        self._on_begin("train")

    def on_test_begin(self, logs=None):
        self._on_begin("test")

    def on_predict_begin(self, logs=None):
        self._on_begin("predict")

    def on_train_end(self, logs=None):
        self._on_end("train")

    def on_test_end(self, logs=None):
        self._on_end("test")

    def on_predict_end(self, logs=None):
        self._on_end("predict")


def _nothing(phase):
    return None
