"""The backend Keras will use, read as Keras reads it, without importing Keras.

`keras-parallel launch` must not import Keras: that starts a backend, and JAX's
runtime must start in the launched processes. Read in Keras 3.15's order
(`keras/src/backend/config.py`), but no `keras.json` is written.
"""

import importlib.abc
import importlib.util
import json
import os
import sys

#: Keras's backend when neither `KERAS_BACKEND` nor `keras.json` names one.
DEFAULT_BACKEND = "tensorflow"


def config_path():
    """The path of the `keras.json` Keras reads (it may not exist)."""
    if "KERAS_HOME" in os.environ:
        directory = os.environ["KERAS_HOME"]
    else:
        home = os.path.expanduser("~")
        if not os.access(home, os.W_OK):
            home = "/tmp"
        directory = os.path.join(home, ".keras")
    return os.path.expanduser(os.path.join(directory, "keras.json"))


def configured_backend():
    """The backend Keras will use in a process started with this environment.

    Returns:
        `(backend, source)`: the backend name (not checked), and where it comes
        from: `"KERAS_BACKEND"`, the `keras.json` path, or Keras's default.
    """
    backend = os.environ.get("KERAS_BACKEND")
    if backend:
        return backend, "KERAS_BACKEND"
    path = config_path()
    config = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError):
            # As Keras: not JSON counts as empty (unreadable fails its import).
            config = {}
    if isinstance(config, dict) and "backend" in config:
        return config["backend"], path
    return DEFAULT_BACKEND, f"Keras's default: no KERAS_BACKEND, no backend in {path}"


def after_keras_import(callback):
    """Runs `callback()` once Keras is imported: now if it is, else then.

    For what must precede the user's first Keras call. Until then a finder on
    `sys.meta_path` waits for Keras, importing nothing. A callback that raises
    fails that import of Keras, and runs again at the next.
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        callback()
        return
    sys.meta_path.insert(0, _AfterKerasImport(callback))


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """Finds Keras through the other finders, and runs a callback after it."""

    def __init__(self, callback):
        self.callback = callback
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "keras" or self._finding:
            return None
        self._finding = True  # The other finders find Keras.
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenCall(spec.loader, self)
        return spec

    def loaded(self):
        # Only now: a `find_spec("keras")` alone (a version check) must not
        # end the wait.
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            self.callback()
        except BaseException:
            # Keras's import fails and `keras` leaves `sys.modules`: the next
            # import must run the callback again, not succeed without it.
            sys.meta_path.insert(0, self)
            raise


class _ThenCall(importlib.abc.Loader):
    """A module's loader, then the finder's callback (`after_keras_import`)."""

    def __init__(self, loader, finder):
        self.loader = loader
        self.finder = finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # The module keeps its own loader, as if nobody had waited for it.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.loaded()
