"""The `keras-parallel` command: demo, env, --version, and launch's bad input.

Run as a user runs it: the installed console script in a subprocess (the
module when the script is not installed), on the backend of the tox env.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import keras
import pytest
from subprocesses import checkout_env

import keras_parallel

BACKEND = keras.backend.backend()


def _command():
    script = os.path.join(os.path.dirname(sys.executable), "keras-parallel")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", "keras_parallel.cli"]


def _run(*args, timeout=120, cwd=None, **variables):
    """Runs the command; `variables` set (or, given `None`, unset) variables."""
    # The keras_parallel these tests imported, also when run from a
    # checkout; scikit-learn for the demo's digits; TensorFlow kept out of
    # a JAX or torch process (subprocesses.checkout_env).
    backend = variables.get("KERAS_BACKEND", BACKEND)
    env = checkout_env(
        scikit_learn=True,
        tensorflow=backend not in ("jax", "torch"),
        KERAS_BACKEND=BACKEND,
        OMP_NUM_THREADS="1",
    )
    env.update(variables)
    env = {name: value for name, value in env.items() if value is not None}
    return subprocess.run(
        _command() + list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def test_version():
    result = _run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"keras-parallel {keras_parallel.__version__}"


def test_env_names_keras_backend_and_devices():
    result = _run("env")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"keras: {keras.version()}" in result.stdout or "keras-nightly" in (
        result.stdout
    )
    assert f"backend: {BACKEND} (from KERAS_BACKEND)" in result.stdout
    assert "devices: " in result.stdout
    # The matrix's own releases, said to be in the tested range.
    assert any(
        line.startswith(("keras: ", "keras-nightly: ")) and line.endswith("(tested)")
        for line in result.stdout.splitlines()
    ), result.stdout


def test_env_names_the_backend_keras_json_chooses(tmp_path):
    # No KERAS_BACKEND: Keras reads $KERAS_HOME/keras.json, and so must env.
    (tmp_path / "keras.json").write_text(f'{{"backend": "{BACKEND}"}}')
    result = _run("env", KERAS_BACKEND=None, KERAS_HOME=str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"backend: {BACKEND} (from {tmp_path / 'keras.json'})" in result.stdout
    assert "devices: unavailable" not in result.stdout


@pytest.mark.parametrize("option", ["--devices", "--batch-size", "--epochs"])
def test_demo_refuses_non_positive_numbers(option):
    result = _run("demo", option, "0")
    assert result.returncode == 2
    assert f"argument {option}: must be a positive integer" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_trains_on_two_devices_and_prints_the_plan():
    # The command as the README gives it, short: one epoch on 2 devices (2
    # processes on torch). The plan names the 2-device mesh.
    result = _run(
        "demo", "--devices", "2", "--epochs", "1", "--batch-size", "64", timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Mesh: batch=2 (2 devices" in result.stdout
    processes = "2 processes" if BACKEND == "torch" else "1 process"
    assert f"Backend: {BACKEND}, 2 devices in {processes}" in result.stdout
    assert "Test accuracy: " in result.stdout
    assert "Throughput (last epoch): " in result.stdout
    assert result.stdout.count("Throughput (last epoch): ") == 1


@pytest.mark.parametrize("count", ["0", "two"])
def test_launch_refuses_a_count_that_is_not_positive(tmp_path, count):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    result = _run("launch", "--backend", "torch", "--nproc", count, str(script))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("keras-parallel launch: error: ")
    assert (
        f"--nproc must be a positive number of processes. Received: --nproc {count}"
        in (result.stderr)
    )
    assert "Traceback" not in result.stderr and "ran" not in result.stdout


def test_launch_names_a_missing_script_once(tmp_path):
    result = _run(
        "launch", "--backend", "torch", "--nproc", "2", "no_such_train.py", cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.count("no_such_train.py") == 2  # script, received
    assert result.stderr.count("does not exist") == 1
    assert "Traceback" not in result.stderr


def test_launch_needs_a_backend_it_can_launch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    result = _run("launch", "--backend", "numpy", "--nproc", "2", str(script))
    assert result.returncode == 2
    assert "pass --backend jax, --backend tensorflow or --backend torch" in (
        result.stderr
    )


def test_launch_help_works_with_or_without_torch():
    result = _run("launch", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: keras-parallel launch [--backend B] [--nproc N]" in result.stdout
    if shutil.which("torchrun") is None and BACKEND != "torch":
        assert "torch is not installed" in result.stdout or "torchrun" in result.stdout


def test_launch_names_the_rank_that_failed_first_not_its_consequences():
    from types import SimpleNamespace as Failure

    from keras_parallel.launcher import command as launch_command

    def first(failures):
        return launch_command._first_cause(Failure(failures=failures))[0]

    raised = Failure(message="ValueError: boom", exitcode=1, timestamp=10)
    exited = Failure(message="", exitcode=3, timestamp=10)
    peer = Failure(message="PeerFailedError: Rank 1 failed", exitcode=1, timestamp=9)
    terminated = Failure(message="Signal 15 (SIGTERM)", exitcode=-15, timestamp=9)
    assert first({0: peer, 1: raised}) == 1
    assert first({0: terminated, 1: exited}) == 1
    assert first({0: raised, 1: exited}) == 0  # Same second: the lower rank.
    # A gloo size mismatch aborts one rank; torchrun then ends the other.
    aborted = Failure(message="Signal 6 (SIGABRT)", exitcode=-6, timestamp=9)
    assert first({0: terminated, 1: aborted}) == 1


def test_help_names_every_backend_launch_runs_on():
    result = _run("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "JAX through `jax.distributed`" in result.stdout
    assert "TensorFlow through" in result.stdout


def test_launch_port_check_takes_a_time_wait_port_not_a_listening_one():
    import socket

    from keras_parallel.launcher import ports

    # The server side closes first, as the engines' servers do when a run
    # ends: its end of the connection stays in TIME-WAIT for about 60 s.
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # What the old check did: refused.
    ports.check_port_free("127.0.0.1", port, role="worker 0")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        taken = listening.getsockname()[1]
        with pytest.raises(
            ValueError, match=f"worker 0 port is taken. Received: port {taken}"
        ):
            ports.check_port_free("127.0.0.1", taken, role="worker 0")


def test_torchs_gloo_is_kept_on_loopback_unless_the_user_chose(monkeypatch):
    from keras_parallel.launcher import ports

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    assert ports.gloo_on_loopback()["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert ports.gloo_on_loopback() == {}


def test_launch_names_a_process_killed_by_a_signal(capfd):
    # SIGKILL (the out-of-memory killer's) leaves no traceback to point to.
    from keras_parallel.launcher import supervisor

    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    code = supervisor.supervise([([sys.executable, "-c", kill], dict(os.environ))])
    err = capfd.readouterr().err
    assert code == 1
    assert "keras-parallel launch: process 0 was killed by signal 9 (SIGKILL)" in err
    assert "traceback" not in err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_reaches_every_process_and_ends_the_launch(
    tmp_path, signum
):
    # The JAX and TensorFlow launcher's supervisor, stopped as Ctrl-C or a
    # scheduler stops it: each process gets the same signal, and the
    # launch ends with 128 + its number, nothing left. (The processes' own
    # way to stop, a backup written, is test_faults' and test_preemption's.)
    from subprocesses import gone, start_in_session

    child = (
        "import signal, sys, time; "
        "signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "got = lambda s, f: (open(sys.argv[1], 'w').write(str(s)), sys.exit(0)); "
        "[signal.signal(s, got) for s in (signal.SIGINT, signal.SIGTERM)]; "
        "open(sys.argv[1] + '.ready', 'w').close(); time.sleep(60)"
    )
    launcher = (
        "import os, sys; from keras_parallel.launcher import supervisor; "
        "sys.exit(supervisor.supervise([([sys.executable, '-c', sys.argv[1], "
        "os.path.join(sys.argv[2], f'got{i}')], dict(os.environ)) for i in (0, 1)]))"
    )
    process = start_in_session(
        [sys.executable, "-c", launcher, child, str(tmp_path)], dict(os.environ)
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"got{i}.ready").exists() for i in (0, 1)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the processes never started"
        time.sleep(0.05)
    os.kill(process.pid, signum)
    try:
        _, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 128 + signum, err
    assert f"stopped by signal {int(signum)}; passing it to every process" in err
    assert [(tmp_path / f"got{i}").read_text() for i in (0, 1)] == [
        str(int(signum))
    ] * 2
    assert gone(str(tmp_path)) == []


def test_launch_names_the_process_with_the_cause_not_one_a_peer_broke(capfd):
    # Process 0's collective broke when process 1 failed (its gloo
    # connection reset), and it exited first: process 1's error is named.
    from keras_parallel.launcher import supervisor

    broken = f"raise SystemExit({supervisor.BROKEN_COLLECTIVE_EXIT_CODE})"
    cause = "import time; time.sleep(1); raise SystemExit(3)"
    commands = [
        ([sys.executable, "-c", broken], dict(os.environ)),
        ([sys.executable, "-c", cause], dict(os.environ)),
    ]
    assert supervisor.supervise(commands) == 3
    err = capfd.readouterr().err
    assert "keras-parallel launch: process 1 failed with exit code 3" in err
    assert "process 0" not in err
    # Alone, the broken collective is the failure named.
    assert supervisor.supervise(commands[:1]) == 1
    err = capfd.readouterr().err
    assert "process 0 failed in a collective a peer broke" in err


def test_launch_started_by_a_joined_process_lets_its_processes_join(tmp_path):
    # A joined process's children inherit KERAS_PARALLEL_JOINED_PID and run
    # alone (cluster_join.may_join); a launcher started from one starts a
    # group of its own, whose processes must not inherit it.
    from keras_parallel.cluster_environments.join import JOINED_PID_VAR
    from keras_parallel.launcher import supervisor

    seen = tmp_path / "env.txt"
    write = (
        "import os, sys; open(sys.argv[1], 'w').write("
        f"repr((os.environ.get({JOINED_PID_VAR!r}), "
        f"os.environ.get({supervisor.RESTART_ENV!r}))))"
    )
    env = dict(os.environ, **{JOINED_PID_VAR: "12345"})
    code = supervisor.supervise([([sys.executable, "-c", write, str(seen)], env)])
    assert code == 0
    assert seen.read_text() == repr((None, "0"))
