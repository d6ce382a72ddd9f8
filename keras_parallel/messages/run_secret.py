"""The run's secret: what every process of one run knows and nobody else.

Whoever starts a run makes it (`keras-parallel launch` on one node,
`keras_parallel.launch`) and hands it to the processes it starts in
`KERAS_PARALLEL_RUN_SECRET`. Under a cluster's launcher (torchrun, srun,
mpirun) or several nodes, give it yourself, the same on every process: in
that variable, or in a file only your user can read, named by
`KERAS_PARALLEL_RUN_SECRET_FILE` (docs/multihost.md, "Network and trust").
`signed_store` tags every value keras_parallel writes to the run's store
with it.

Example:

```python
env = dict(os.environ, **run_secret.for_children(os.environ))
```
"""

import os
import secrets
import stat
import sys

SECRET_VARIABLE = "KERAS_PARALLEL_RUN_SECRET"
SECRET_FILE_VARIABLE = "KERAS_PARALLEL_RUN_SECRET_FILE"
#: Said once per process where a run has no secret.
_warned = []


class RunSecretError(ValueError):
    """The run's secret was named but cannot be used."""


def for_children(environ=None):
    """The variables that give the processes a launcher starts the run's
    secret: the one in `environ` where there is one, else a new one.

    Args:
        environ: the launcher's environment (default: `os.environ`).

    Returns:
        `{name: value}` to add to each child's environment; empty where
        `environ` names a secret file (the children read it themselves).
    """
    environ = os.environ if environ is None else environ
    if environ.get(SECRET_VARIABLE) or environ.get(SECRET_FILE_VARIABLE):
        return {}
    return {SECRET_VARIABLE: secrets.token_hex(32)}  # 32 random bytes.


def run_secret(environ=None):
    """This process's run secret, as bytes, or None where none was given.

    Args:
        environ: the environment to read (default: `os.environ`).

    Returns:
        The secret's bytes; None (said once on stderr: the run's messages
        are then tagged but anyone who can reach its store could forge
        them) where neither variable is set.

    Raises:
        RunSecretError: the secret file cannot be read, is empty, or others
            than its owner may read or write it.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(SECRET_VARIABLE)
    if value:
        return value.encode()
    path = environ.get(SECRET_FILE_VARIABLE)
    if path:
        return _read_secret_file(path)
    if not _warned:
        _warned.append(True)
        print(
            "keras_parallel: warning: this run has no secret: its processes' "
            "messages are not authenticated, and anyone who can reach its "
            f"store could forge them. Received: neither {SECRET_VARIABLE} nor "
            f"{SECRET_FILE_VARIABLE} set; give every process the same secret "
            "(`keras-parallel launch` on one node makes one itself).",
            file=sys.stderr,
            flush=True,
        )
    return None


def _read_secret_file(path):
    try:
        status = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as error:
        raise RunSecretError(
            f"the run's secret file cannot be read. Received: "
            f"{SECRET_FILE_VARIABLE}={path!r} ({error.strerror}); name a file "
            "that holds the secret."
        ) from None
    if hasattr(os, "getuid") and status.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RunSecretError(
            f"the run's secret file may be read or written by others. "
            f"Received: {path!r} with mode {stat.filemode(status.st_mode)}; "
            f"make it your user's alone (`chmod 600 {path}`)."
        )
    if not secret:
        raise RunSecretError(
            f"the run's secret file is empty. Received: {path!r}; write the "
            'secret in it (for example `python -c "import secrets; '
            'print(secrets.token_hex(32))"`).'
        )
    return secret
