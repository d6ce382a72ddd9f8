"""A signal's whole action, saved and put back, native handlers included.

Python's `signal.signal` returns the handler it last installed itself, not
the one in force: a handler installed by native code after Python started
(JAX's preemption notifier sets one for SIGTERM when `jax.distributed`
starts) is reported as `SIG_DFL`, and "restoring" that would remove it.
`save` reads the action from the system (`sigaction`), `restore` installs
Python's previous handler (so that `signal.getsignal` says what Python
knows) and then the saved action itself. The action is kept as opaque
bytes: no layout of `struct sigaction` is assumed.

Where the system's `sigaction` cannot be called (not a POSIX libc), `save`
returns None and `restore` puts Python's previous handler back alone.
"""

import ctypes
import signal

#: Larger than any `struct sigaction` (glibc x86-64: 152 bytes; macOS: 16).
_ACTION_BYTES = 512


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "sigaction") else None
    except OSError:
        return None


def save(number):
    """The action in force for signal `number`, as bytes (or None)."""
    libc = _libc()
    if libc is None:
        return None
    action = ctypes.create_string_buffer(_ACTION_BYTES)
    if libc.sigaction(int(number), None, action) != 0:
        return None
    return action.raw


def install(number, handler):
    """Installs the Python `handler`; returns what `restore` needs."""
    saved = save(number)
    previous = signal.signal(number, handler)
    return previous, saved


def restore(number, installed):
    """Puts back the action `install` replaced.

    Args:
        number: the signal.
        installed: `install`'s return value.
    """
    previous, saved = installed
    signal.signal(number, previous if previous is not None else signal.SIG_DFL)
    libc = _libc()
    if saved is not None and libc is not None:
        action = ctypes.create_string_buffer(saved, _ACTION_BYTES)
        libc.sigaction(int(number), action, None)
