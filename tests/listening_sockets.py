"""The TCP sockets a process tree listens on, read from `/proc` (Linux).

`/proc/net/tcp` and `/proc/net/tcp6` list every listening socket with its
inode; `/proc/<pid>/fd` links each of a process's sockets to its inode.
"""

import ipaddress
import os
import re


def _address(hex_address):
    raw = bytes.fromhex(hex_address)
    # The kernel writes each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listening():
    """`{inode: (address, port)}` of every listening TCP socket."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                address, port = fields[1].split(":")
                found[fields[9]] = (_address(address), int(port, 16))
    return found


def _children():
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    return children


def tree_of(pid):
    """`pid` and every process below it."""
    children, out, queue = _children(), [], [pid]
    while queue:
        current = queue.pop()
        out.append(current)
        queue.extend(children.get(current, ()))
    return out


def listening_sockets(pid):
    """`[(pid, address, port)]`: what `pid` and its descendants listen on."""
    sockets = _listening()
    out = []
    for process in tree_of(pid):
        try:
            links = os.listdir(f"/proc/{process}/fd")
        except OSError:
            continue
        for fd in links:
            try:
                target = os.readlink(f"/proc/{process}/fd/{fd}")
            except OSError:
                continue
            found = re.fullmatch(r"socket:\[(\d+)\]", target)
            if found and found.group(1) in sockets:
                out.append((process, *sockets[found.group(1)]))
    return out


def is_loopback(address):
    """127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6."""
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def sockets_while_in_fit(command, env, directory, processes, timeout):
    """What `command`'s processes listen on once `processes` of them wait in
    `fit` (`listening_script.py`), and the command's result.

    Returns:
        `(sockets, CompletedProcess)`: `listening_sockets` of the command's
        tree at that moment; the command run to its end (its session killed
        whole if it runs past `timeout` seconds, or fails to get there).
    """
    import pathlib
    import signal
    import subprocess
    import time

    from subprocesses import start_in_session

    process = start_in_session(command, env)
    try:
        deadline = time.monotonic() + timeout
        while len(list(pathlib.Path(directory).glob("in_fit.*"))) < processes:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"no {processes} processes reached fit: {process.communicate()}"
                )
            time.sleep(0.2)
        sockets = listening_sockets(process.pid)
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return sockets, subprocess.CompletedProcess(command, process.returncode, out, err)


def assert_loopback_only(sockets, result):
    """The run ended well, listened, and only on loopback."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert sockets, "the run listened on nothing: nothing was seen"
    wide = [s for s in sockets if not is_loopback(s[1])]
    assert not wide, f"listening beyond loopback: {wide} (all: {sockets})"
