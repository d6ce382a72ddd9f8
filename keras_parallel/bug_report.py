"""`keras-parallel env`: what to put in a bug report.

The versions of Python, keras_parallel, Keras and every backend library
installed (read from the package metadata, so nothing is imported that the
report does not need), the backend Keras would use, and the devices it sees.
"""

import importlib.metadata
import os
import platform

_PACKAGES = (
    "keras",
    "keras-nightly",
    "jax",
    "jaxlib",
    "torch",
    "tensorflow",
    "tensorflow-cpu",
    "numpy",
    "orbax-checkpoint",
)


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices():
    # Importing keras starts the backend named by KERAS_BACKEND.
    try:
        from keras_parallel.backends import executor_class

        devices = executor_class().list_devices()
    except Exception as error:  # A report must print even so.
        return f"unavailable ({type(error).__name__}: {error})"
    return f"{len(devices)} ({', '.join(devices)})"


def report():
    """The bug-report text: versions, backend and devices, one per line.

    Returns:
        A string.

    Example:

    >>> print(keras_parallel.bug_report.report())  # or `keras-parallel env`
    """
    from keras_parallel import __version__

    lines = [
        f"keras-parallel: {__version__}",
        f"python: {platform.python_version()} ({platform.platform()})",
    ]
    for name in _PACKAGES:
        version = _version(name)
        if version is not None:
            lines.append(f"{name}: {version}")
    backend = os.environ.get("KERAS_BACKEND")
    lines.append(
        f"KERAS_BACKEND: {backend}"
        if backend
        else "KERAS_BACKEND: (not set: Keras uses its config file, else tensorflow)"
    )
    lines.append(f"devices: {_devices()}")
    return "\n".join(lines)
