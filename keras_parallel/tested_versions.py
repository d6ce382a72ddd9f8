"""The releases the test matrix runs on: the oldest and the newest of each.

`tests/test_tested_versions.py` keeps this equal to the `constraints*.txt`
files, which are not installed, so `keras-parallel env` reads it here.
"""

#: `{distribution name: (oldest, newest)}`; `keras-nightly` pins one build.
TESTED = {
    "keras": ("3.15.0", "3.15.1"),
    "keras-nightly": ("3.16.0.dev2026102704", "3.16.0.dev2026102704"),
    "jax": ("0.7.0", "0.10.2"),
    "jaxlib": ("0.7.0", "0.10.2"),
    "torch": ("2.13.0", "2.15.0"),
    "tensorflow-cpu": ("2.20.0", "2.21.0"),
    "tensorflow": ("2.20.0", "2.21.0"),
    "numpy": ("2.1.3", "2.4.6"),
}


def _key(version):
    """A sortable key of a version: its leading numbers, then the rest."""
    import re

    release = version.split("+")[0]
    numbers = [int(n) for n in re.findall(r"\d+", release.split("dev")[0])[:3]]
    dev = release.split("dev")[1] if "dev" in release else None
    # A development build sorts before its release.
    return (*numbers, 0 if dev is not None else 1, int(dev) if dev else 0)


def tested_range(name, version):
    """Whether `version` of `name` is in the tested range, in words.

    Args:
        version: e.g. `"2.14.1"`; a local part such as `+cpu` is ignored.

    Returns:
        `"tested"`, `"older than tested (2.13.0 to 2.15.0)"`, `"newer than
        tested (...)"`, or None for a package the matrix does not pin.

    Example:

    >>> tested_range("torch", "2.13.0+cpu")
    'tested'
    """
    if name not in TESTED:
        return None
    oldest, newest = TESTED[name]
    key = _key(version)
    span = f"{oldest} to {newest}" if oldest != newest else oldest
    if key < _key(oldest):
        return f"older than tested ({span})"
    if key > _key(newest):
        return f"newer than tested ({span})"
    return "tested"
