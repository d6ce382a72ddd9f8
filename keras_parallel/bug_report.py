"""`keras-parallel env`: what to put in a bug report.

Versions are read from package metadata, so nothing is imported that the
report does not need.
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
    try:
        from keras_parallel.backends import executor_class

        devices = executor_class().list_devices()
    except Exception as error:  # A report must print even so.
        return f"unavailable ({type(error).__name__}: {error})"
    return f"{len(devices)} ({', '.join(devices)})"


def report():
    """The bug-report text: versions, backend and devices, one per line.

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
    # Read before `_devices` imports Keras, as Keras would read it.
    backend, source = keras_config.configured_backend()
    lines.append(f"backend: {backend} (from {source})")
    environment = cluster_environments.describe_environment()
    lines.append(f"cluster environment: {environment}")
    lines.append(f"devices: {_devices()}")
    return "\n".join(lines)
