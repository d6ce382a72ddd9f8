"""The tested range `keras-parallel env` reports equals the test matrix's
pins (`constraints.txt`, `constraints-oldest.txt`)."""

import os

from keras_parallel import tested_versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins(name):
    pins = {}
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if "==" in line:
                package, version = line.split("==")
                pins[package.strip()] = version.strip()
    return pins


def test_the_table_is_the_matrix_pins():
    oldest, newest = _pins("constraints-oldest.txt"), _pins("constraints.txt")
    # The opt-in newest torch: the default pins with another torch.
    newest_torch = _pins("constraints-newest.txt")
    assert {k: v for k, v in newest_torch.items() if k != "torch"} == {
        k: v for k, v in newest.items() if k != "torch"
    }
    newest["torch"] = newest_torch["torch"]
    for name, (low, high) in tested_versions.TESTED.items():
        if name in ("tensorflow", "jaxlib"):  # Pinned as tensorflow-cpu, jax.
            base = {"tensorflow": "tensorflow-cpu", "jaxlib": "jax"}[name]
            assert (low, high) == tested_versions.TESTED[base]
            continue
        if name == "keras-nightly":
            assert low == high == newest[name]
            continue
        assert (low, high) == (oldest[name], newest[name]), name


def test_versions_are_placed_in_the_range():
    assert tested_versions.tested_range("torch", "2.13.0+cpu") == "tested"
    assert tested_versions.tested_range("torch", "2.14.1") == "tested"
    assert tested_versions.tested_range("torch", "2.16.0") == (
        "newer than tested (2.13.0 to 2.15.0)"
    )
    assert tested_versions.tested_range("jax", "0.8.1") == "tested"
    assert tested_versions.tested_range("jax", "0.6.2") == (
        "older than tested (0.7.0 to 0.10.2)"
    )
    assert tested_versions.tested_range("keras", "3.16.0") == (
        "newer than tested (3.15.0 to 3.15.1)"
    )
    # A development build comes before its release.
    assert tested_versions.tested_range("keras", "3.15.1.dev2026") == "tested"
    assert tested_versions.tested_range("scipy", "1.0") is None
