"""The backend Keras will use, read as Keras reads it, without importing Keras.

`keras-parallel launch` must not import Keras: importing it starts a backend,
and JAX's runtime must start in the processes the launcher starts, not in
the launcher. So this module reads the sources Keras reads, in Keras's order
(`keras/src/backend/config.py`, Keras 3.15):

1. `KERAS_BACKEND`, when set and not empty;
2. the `"backend"` of `keras.json` in `$KERAS_HOME`, else in `~/.keras`
   (`/tmp/.keras` when the home directory is not writable); a file that is
   not JSON counts as empty;
3. `"tensorflow"`, Keras's default.

Unlike Keras, it never writes a `keras.json`.
"""

import json
import os

#: Keras's backend when neither `KERAS_BACKEND` nor `keras.json` names one.
DEFAULT_BACKEND = "tensorflow"


def config_path():
    """The `keras.json` Keras reads (it may not exist).

    Returns:
        The path, as Keras builds it.
    """
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
        `(backend, source)`: the backend name as Keras will read it (not
        checked), and where it comes from, for messages: `"KERAS_BACKEND"`,
        the `keras.json` path, or Keras's default.
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
            # Keras counts a file that is not JSON as empty; one it cannot
            # open fails Keras's own import, which says why.
            config = {}
    if isinstance(config, dict) and "backend" in config:
        return config["backend"], path
    return DEFAULT_BACKEND, f"Keras's default: no KERAS_BACKEND, no backend in {path}"
