"""Tests that start no backend run in one env of the matrix, not in three.

`tox` runs the suite once per backend; a test whose processes import no
backend would prove the same thing three times. Such a module says
`pytestmark = backend_neutral.once`; it runs where `KERAS_BACKEND` is
`ENV_BACKEND`, and is skipped elsewhere, saying where it ran.
"""

import os

import pytest

#: The env that runs the backend-neutral tests (the default suite's
#: shortest env, tests/README.md).
ENV_BACKEND = "tensorflow"

once = pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND", "jax") != ENV_BACKEND,
    reason=f"starts no backend: runs once, in the {ENV_BACKEND} env",
)
