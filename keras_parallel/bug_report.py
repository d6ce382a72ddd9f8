"""`keras-parallel env`: what to put in a bug report.

The versions of Python, keras_parallel, Keras and every backend library
installed (read from the package metadata, so nothing is imported that the
report does not need), each said to be in the tested range or not
(`tested_versions`), the backend Keras would use, the cluster environment
detected (`cluster_environments`), and the devices it sees.
"""

import importlib.metadata
import platform

from keras_parallel import cluster_environments, keras_config, tested_versions

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
            tested = tested_versions.tested_range(name, version)
            lines.append(f"{name}: {version}" + (f" ({tested})" if tested else ""))
    # Read as Keras reads it, before `_devices` imports Keras: the backend a
    # script gets, and where that comes from (KERAS_BACKEND, keras.json).
    backend, source = keras_config.configured_backend()
    lines.append(f"backend: {backend} (from {source})")
    environment = cluster_environments.describe_environment()
    lines.append(f"cluster environment: {environment}")
    lines.append(f"devices: {_devices()}")
    return "\n".join(lines)
