"""A signal's whole action, saved and put back, native handlers included.

`signal.signal` returns the handler Python last installed, not the one in
force: a native one set later (JAX's preemption notifier's, for SIGTERM) reads
as `SIG_DFL`, and restoring that would remove it. So `save` reads the action
with `sigaction`, as opaque bytes, and `restore` puts back Python's previous
handler, then that action (without `sigaction`, the handler alone).
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
    saved = save(number)  # Before `handler` replaces it.
    return signal.signal(number, handler), saved


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
