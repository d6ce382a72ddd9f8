"""`keras_parallel.launcher.ports`: the ports a launch of one node chooses."""

import socket

import pytest
from backend_neutral import once

from keras_parallel.launcher import ports

pytestmark = once


def test_a_free_port_is_below_the_kernels_ephemeral_range(monkeypatch, tmp_path):
    # The kernel hands out ports of its ephemeral range to any program's
    # outgoing connection or bind(0): one chosen there can be taken before
    # the coordinator binds it (seen with two test runs side by side).
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(range_file))
    chosen = {ports.free_port() for _ in range(50)}
    assert all(ports.LOWEST_CHOSEN_PORT <= port < 32768 for port in chosen)
    assert len(chosen) > 1  # Chosen at random, not the same each time.


def test_a_taken_port_is_not_chosen(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        choices = iter([port, port, port + 1 if port < 65535 else port - 1])
        monkeypatch.setattr(ports._CHOOSER, "randrange", lambda *_: next(choices))
        assert ports.free_port() != port


def test_without_the_ranges_file_the_iana_range_is_avoided(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert all(ports.free_port() < 49152 for _ in range(20))


def test_the_choice_ignores_the_seed_keras_sets():
    # keras.utils.set_random_seed seeds `random`: two runs seeded alike
    # (two test runs side by side) must still choose apart.
    import random

    chosen = []
    for _ in range(2):
        random.seed(1)
        chosen.append([ports.free_port() for _ in range(5)])
    assert chosen[0] != chosen[1]


@pytest.mark.parametrize("content", ["", "not a number"])
def test_an_unreadable_ranges_file_is_the_iana_range(monkeypatch, tmp_path, content):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(content)
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(range_file))
    assert ports._ephemeral_low() == 49152


def test_jax_gloo_beyond_loopback_is_said_once(capsys):
    assert ports.warn_if_gloo_reachable("launch", resolve=lambda: "10.0.0.5")
    err = capsys.readouterr().err
    assert "listen on 10.0.0.5" in err and "no interface" in err
    assert not ports.warn_if_gloo_reachable("launch", resolve=lambda: "127.0.1.1")
    assert not ports.warn_if_gloo_reachable("launch", resolve=lambda: None)
    assert capsys.readouterr().err == ""


def _bind(port, reuse_port):
    """None, or the `OSError` of a bind to 127.0.0.1:`port` (as a server of
    this user with `SO_REUSEPORT`, gRPC's way, or as any other program)."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            other.bind(("127.0.0.1", port))
        except OSError as error:
            return error
    return None


def test_a_held_port_is_refused_to_every_bind_but_this_users_server():
    import os

    holder = ports.hold_free_port()
    try:
        port = holder.getsockname()[1]
        assert ports.LOWEST_CHOSEN_PORT <= port
        assert _bind(port, reuse_port=False) is not None  # Any other program.
        assert _bind(port, reuse_port=True) is None  # This user's gRPC server.
        if os.geteuid() == 0:
            # Another user, even with SO_REUSEPORT: the kernel refuses it.
            pid = os.fork()
            if pid == 0:
                os.setuid(65534)
                os._exit(0 if _bind(port, reuse_port=True) is not None else 1)
            assert os.waitpid(pid, 0)[1] == 0, "another user bound the held port"
    finally:
        holder.close()
    assert _bind(port, reuse_port=False) is None  # Released once closed.


def test_the_jax_launch_holds_the_coordinators_port_while_it_runs(monkeypatch):
    from keras_parallel.launcher import jax_processes, local_processes

    seen = {}

    def run(attempt, args, **_):
        for number in (0, 1):  # A restart holds a fresh port.
            attempt(number)
            seen[number] = args.master_port
            assert _bind(args.master_port, reuse_port=False) is not None, number
        return 0

    monkeypatch.setattr(local_processes, "run", run)
    monkeypatch.setattr(ports, "warn_if_gloo_reachable", lambda *_: None)
    assert jax_processes.main(["--nproc-per-node", "2", __file__]) == 0
    assert seen[0] != seen[1]
    for port in seen.values():  # Released when the launch returns.
        assert _bind(port, reuse_port=False) is None
