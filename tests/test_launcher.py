"""`keras_parallel.launch` (module `launcher`): processes started on torch.distributed.

`launch()` is tested with trivial functions (no model) so that the process
machinery is tested apart from DDP; `tests/test_torch_executor.py` runs
training through it. The CLI is tested through its torchrun arguments and
one end-to-end run of a small script.
"""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the launcher starts torch processes"
)

if keras.backend.backend() == "torch":
    pytest.importorskip("torch")

import torch_workers as workers  # noqa: E402
from subprocesses import checkout_env, gone, run_in_session, running  # noqa: E402


def _launch():
    from keras_parallel.launcher import torch_processes as launcher

    return launcher


def test_results_are_rank_ordered():
    import keras_parallel

    results = keras_parallel.launch(workers.echo, 3, args=("hi",), timeout=60)
    assert results == [(0, "hi", "3"), (1, "hi", "3"), (2, "hi", "3")]


def test_failing_rank_reraises_its_exception_with_traceback():
    with pytest.raises(KeyError, match="no such key on rank 1") as raised:
        _launch().launch(workers.echo, 2, args=("x", 1), timeout=60)
    assert raised.value.rank == 1
    cause = raised.value.__cause__
    assert "torch_workers.py" in str(cause) and "echo" in str(cause)


def test_timeout_ends_every_process():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\].*timeout=3"):
        _launch().launch(workers.sleep_forever, 2, timeout=3)
    assert time.monotonic() - start < 30
    import multiprocessing

    assert not [
        p
        for p in multiprocessing.active_children()
        if p.name.startswith("keras-parallel-rank")
    ]


def test_bad_num_processes():
    with pytest.raises(ValueError, match="num_processes must be a positive int"):
        _launch().launch(workers.echo, 0)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--nproc", "2", "train.py", "--epochs", "3"],
            ["--standalone", "--nproc-per-node", "2", "train.py", "--epochs", "3"],
        ),
        (
            ["--nproc=4", "--master-port", "1234", "t.py"],
            ["--nproc-per-node=4", "--master-port", "1234", "t.py"],
        ),
        (
            ["--nproc", "2", "--max-restarts", "1", "t.py", "--nproc", "9"],
            [
                "--standalone",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                "t.py",
                "--nproc",
                "9",
            ],
        ),
    ],
)
def test_cli_passes_torchrun_options(argv, expected):
    from keras_parallel.launcher import command as launch_command

    assert launch_command._torchrun_args(argv)[0] == expected


def test_cli_puts_a_one_node_run_on_the_loopback_rendezvous(monkeypatch):
    from keras_parallel.launcher import bound_rendezvous
    from keras_parallel.launcher import command as launch_command

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # Unset, and restored after.
    args = ["--standalone", "--nproc-per-node", "2", "-m", "boot", "t.py", "--x"]
    out = launch_command._bound_rendezvous(args, "t.py")
    assert "--standalone" not in out
    assert out[out.index("--rdzv-backend") + 1] == bound_rendezvous.BACKEND
    assert out[out.index("--local-addr") + 1] == "127.0.0.1"
    assert out[-6:] == ["--nproc-per-node", "2", "-m", "boot", "t.py", "--x"]
    assert os.environ["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")


def test_cli_binds_node_0s_static_store_to_the_master_address():
    from keras_parallel.launcher import bound_rendezvous
    from keras_parallel.launcher import command as launch_command

    args = ["--nnodes", "2", "--node-rank=1", "--master-addr", "10.1.2.3"]
    args += ["--master-port", "4000", "--rdzv-conf", "timeout=60", "t.py", "--x"]
    out = launch_command._bound_rendezvous(args, "t.py")
    assert out == [
        "--rdzv-backend",
        bound_rendezvous.STATIC,
        "--rdzv-endpoint",
        "10.1.2.3:4000",
        "--nnodes",
        "2",
        "--rdzv-conf",
        "timeout=60,rank=1",
        "t.py",
        "--x",
    ]
    # A rendezvous the user named, untouched.
    several = ["--nnodes", "2", "--rdzv-endpoint", "h:1", "t.py", "--standalone"]
    assert launch_command._bound_rendezvous(several, "t.py") == several


def test_node_0_refuses_a_master_address_that_is_not_its_own():
    from keras_parallel.launcher import bound_rendezvous

    with pytest.raises(ValueError, match="--master-addr 192.0.2.1 --master-port"):
        bound_rendezvous.bound_listener("192.0.2.1", 0)  # TEST-NET-1: nobody's.
    listener = bound_rendezvous.bound_listener("127.0.0.1", 0)
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
    finally:
        listener.close()


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import keras, numpy as np
    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = Net(inputs=inputs, outputs=keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse",
                  distribution=keras_parallel.DataParallel())
    x = np.ones((40, 4), "float32"); y = np.zeros((40, 2), "float32")
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    rank = os.environ["RANK"]
    with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
        f.write(f"{os.environ['WORLD_SIZE']} {history.history['loss'][0]:.6f}")
    if sys.argv[2:] == ["fail"] and rank == "1":
        raise SystemExit(3)
    """
)

# A model with BatchNorm (its statistics are synced when fit ends normally)
# and a callback that raises on rank 1 in the middle of an epoch.
RAISING_SCRIPT = textwrap.dedent(
    """
    import os
    import keras, numpy as np
    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if os.environ["RANK"] == "1" and batch == 3:
                raise ValueError("boom on rank 1")

    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    model = Net(inputs=inputs, outputs=keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse",
                  distribution=keras_parallel.DataParallel())
    x = np.ones((400, 4), "float32"); y = np.zeros((400, 2), "float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[Boom()])
    """
)


def _run_cli(tmp_path, *extra, source=SCRIPT, timeout_s=60, launch_options=None):
    """Runs `keras-parallel launch --nproc 2 train.py` to its end."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = checkout_env(
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        KERAS_PARALLEL_TIMEOUT=str(timeout_s),
    )
    command = [
        sys.executable,
        "-m",
        "keras_parallel.cli",
        "launch",
        *(launch_options or ["--nproc", "2"]),
        str(script),
        str(tmp_path),
        *extra,
    ]
    return run_in_session(command, env, timeout=180)


def test_two_nodes_of_one_process_train_as_one_node_of_two(tmp_path):
    # One node of 2 processes first (the CLI runs a script in n processes);
    # then two launcher invocations and one rendezvous stand in for two hosts.
    import threading

    from keras_parallel.launcher import free_port

    one_node = tmp_path / "one"
    one_node.mkdir()
    result = _run_cli(one_node)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [(one_node / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0].startswith("2 ")
    port = str(free_port())
    results = {}

    def node(rank):
        options = ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1"]
        options += ["--master-addr", "127.0.0.1", "--master-port", port]
        directory = tmp_path / f"node{rank}"
        directory.mkdir()
        results[rank] = _run_cli(directory, launch_options=options)

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)
    for rank in (0, 1):
        assert results[rank].returncode == 0, results[rank].stderr[-3000:]
    lines = [(tmp_path / f"node{r}" / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert lines[0] == lines[1] == (one_node / "rank0.txt").read_text()


def test_cli_exits_with_the_failed_ranks_exit_code(tmp_path):
    result = _run_cli(tmp_path, "fail")
    assert result.returncode == 3, result.stderr[-3000:]
    assert "rank 1 failed with exit code 3" in result.stderr


def test_cli_reports_a_rank_raising_in_fit_within_seconds(tmp_path):
    # The failing rank must report its own error at once: no collective may
    # run while it unwinds (it hung until the collective timeout, 120 s here).
    start = time.monotonic()
    result = _run_cli(tmp_path, source=RAISING_SCRIPT, timeout_s=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "ValueError: boom on rank 1" in result.stderr
    assert "rank 1 failed" in result.stderr
    assert elapsed < 60, elapsed
    assert running(str(tmp_path)) == []


def test_cli_takes_the_backend_from_keras_json(tmp_path):
    # No KERAS_BACKEND: the launcher reads $KERAS_HOME/keras.json as Keras
    # does (it said "Received: backend None").
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "path = os.path.join(sys.argv[1], 'rank' + os.environ['RANK'] + '.txt')\n"
        "open(path, 'w').write(os.environ['KERAS_BACKEND'])\n"
    )
    env = checkout_env(OMP_NUM_THREADS="1", KERAS_HOME=str(tmp_path))
    del env["KERAS_BACKEND"]
    launch = [sys.executable, "-m", "keras_parallel.cli", "launch", "--nproc", "2"]
    result = run_in_session([*launch, str(script), str(tmp_path)], env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "torch"


def test_cli_names_a_rank_killed_by_a_signal(tmp_path):
    # SIGKILL (the out-of-memory killer's) leaves no traceback to point to.
    source = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    result = _run_cli(tmp_path, source=source, launch_options=["--nproc", "1"])
    assert result.returncode == 1, result.stderr[-3000:]
    assert "keras-parallel launch: rank 0 was killed by signal 9 (SIGKILL)." in (
        result.stderr
    )
    assert "traceback is above" not in result.stderr


def test_cli_ctrl_c_ends_every_rank_with_one_line(tmp_path):
    # SIGINT to the launcher alone, as the JAX and TensorFlow launches take
    # it: every rank ended (SIGTERM, no KeyboardInterrupt tracebacks), one
    # line, exit 130. It printed torchrun's SignalException traceback, exit 1.
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], 'started' + os.environ['RANK']), 'w')\n"
        "time.sleep(600)\n"
    )
    env = checkout_env(KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "keras_parallel.cli", "launch"]
    launch += ["--backend", "torch", "--nproc", "2", str(script), str(tmp_path)]
    process = subprocess.Popen(
        launch,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"started{r}").exists() for r in (0, 1)):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        left = gone(str(tmp_path))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        # torchrun starts each rank in a session of its own.
        for pid in running(str(tmp_path)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.count("keras-parallel launch:") == 1, err[-3000:]
    assert "keras-parallel launch: stopped by signal 2; ending every rank." in err
    assert left == []


def test_launch_listens_on_loopback_only(tmp_path):
    # torch's TCPStore binds every interface when it opens its own socket:
    # `launch` hands it one bound to 127.0.0.1.
    from listening_sockets import assert_loopback_only, sockets_while_in_fit

    here = os.path.dirname(os.path.abspath(__file__))
    command = [
        sys.executable,
        os.path.join(here, "listening_script.py"),
        str(tmp_path),
        "launch",
    ]
    env = checkout_env(KERAS_BACKEND="torch", KP_WAIT_S="3")
    assert_loopback_only(*sockets_while_in_fit(command, env, tmp_path, 2, 240))


def test_cli_on_one_node_listens_on_loopback_only(tmp_path):
    # torchrun's --standalone opens two stores on every interface: the
    # launch's own rendezvous keeps one, on 127.0.0.1, for the ranks too.
    from listening_sockets import assert_loopback_only, sockets_while_in_fit

    here = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-m", "keras_parallel.cli", "launch", "--nproc", "2"]
    command += [os.path.join(here, "listening_script.py"), str(tmp_path)]
    env = checkout_env(KERAS_BACKEND="torch", KP_WAIT_S="3")
    sockets, result = sockets_while_in_fit(command, env, tmp_path, 2, 240)
    assert_loopback_only(sockets, result)
    # One store, in the launcher (the first process started: the lowest
    # pid); torchrun's own would be two.
    launcher = min(pid for pid, _, _ in sockets)
    assert len([s for s in sockets if s[0] == launcher]) == 1, sockets


@pytest.mark.parametrize(
    "options, on_loopback",
    [
        (["--nnodes", "1", "--master-port", "29511"], True),
        (["--nnodes=1", "--master-addr", "127.0.0.1", "--master-port", "29511"], True),
        (["--nnodes", "1", "--master-addr", "localhost"], True),
        (["--nnodes", "2", "--master-addr", "127.0.0.1", "--node-rank", "0"], False),
        (["--nnodes", "1", "--master-addr", "10.1.2.3"], False),
    ],
)
def test_one_node_on_a_given_port_keeps_gloo_on_loopback(
    monkeypatch, options, on_loopback
):
    # `--nnodes 1 --master-port P` takes the static rendezvous, not the
    # loopback one: gloo's pairs must still stay on loopback (on a host
    # whose name resolves elsewhere they would listen there). Several
    # nodes, or an address the user named, leave gloo's interface alone.
    from keras_parallel.launcher import command

    # Set, then removed: the test's end restores it as it was.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    command._bound_rendezvous([*options, "train.py"], "train.py")
    expected = "lo" if on_loopback else None
    assert os.environ.get("GLOO_SOCKET_IFNAME") == expected
