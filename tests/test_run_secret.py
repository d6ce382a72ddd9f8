"""`keras_parallel.messages.run_secret`: the secret every process of a run shares."""

import os

import pytest
from backend_neutral import once

from keras_parallel.messages import run_secret
from keras_parallel.messages.run_secret import SECRET_FILE_VARIABLE, SECRET_VARIABLE

pytestmark = once


def test_a_launcher_makes_a_new_secret_unless_one_is_given():
    made = run_secret.for_children({})
    assert len(made[SECRET_VARIABLE]) == 64
    assert made != run_secret.for_children({})
    assert run_secret.for_children({SECRET_VARIABLE: "given"}) == {}
    assert run_secret.for_children({SECRET_FILE_VARIABLE: "/a/file"}) == {}


def test_the_secret_from_its_variable_or_its_file(tmp_path):
    assert run_secret.run_secret({SECRET_VARIABLE: "abc"}) == b"abc"
    path = tmp_path / "secret"
    path.write_text("from the file\n")
    os.chmod(path, 0o600)
    assert run_secret.run_secret({SECRET_FILE_VARIABLE: str(path)}) == b"from the file"


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
@pytest.mark.parametrize("mode", [0o644, 0o660, 0o602])
def test_a_secret_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = tmp_path / "secret"
    path.write_text("s")
    os.chmod(path, mode)
    with pytest.raises(run_secret.RunSecretError, match="chmod 600"):
        run_secret.run_secret({SECRET_FILE_VARIABLE: str(path)})


def test_a_missing_or_empty_secret_file_is_refused(tmp_path):
    with pytest.raises(run_secret.RunSecretError, match="cannot be read"):
        run_secret.run_secret({SECRET_FILE_VARIABLE: str(tmp_path / "none")})
    path = tmp_path / "empty"
    path.write_text("\n")
    os.chmod(path, 0o600)
    with pytest.raises(run_secret.RunSecretError, match="is empty"):
        run_secret.run_secret({SECRET_FILE_VARIABLE: str(path)})


def test_no_secret_is_said_once(capsys, monkeypatch):
    monkeypatch.setattr(run_secret, "_warned", [])
    assert run_secret.run_secret({}) is None
    assert run_secret.run_secret({}) is None
    assert capsys.readouterr().err.count("this run has no secret") == 1
