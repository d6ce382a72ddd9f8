"""`launcher/parent_death.py`: a launched process ends with its launcher.

Plain Python processes (no backend): a "launcher" starts a child the way
keras_parallel's launchers do (the child calls `end_with_launcher` or
`end_with_parent` first), then the launcher is killed with SIGKILL, which
gives it no chance to end its child. The child must be gone within 10 s.
The launches through `keras-parallel launch` on torch and JAX:
tests/test_faults.py (`test_a_killed_launcher_takes_every_process_with_it...`).
"""

import os
import signal
import subprocess
import sys
import time

import backend_neutral
import pytest
from subprocesses import gone

from keras_parallel.launcher import parent_death

pytestmark = [
    backend_neutral.once,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

#: The child: asks to end with its launcher (or parent), says so, waits.
CHILD = (
    "import sys, time; from keras_parallel.launcher import parent_death; "
    "asked = getattr(parent_death, sys.argv[1])(); "
    "print(asked, flush=True); time.sleep(600)"
)
#: The launcher: names itself in the child's environment, starts it, prints
#: the child's pid and what it said, then waits to be killed.
LAUNCHER = (
    "import os, subprocess, sys, time; "
    "from keras_parallel.launcher import parent_death; "
    "env = parent_death.mark_launcher(dict(os.environ)); "
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], "
    "sys.argv[3]], env=env, stdout=subprocess.PIPE, text=True); "
    "print(child.pid, child.stdout.readline().strip(), flush=True); "
    "time.sleep(600)"
)


def _start_launcher(how, marker):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, CHILD, how, marker],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pid, asked = launcher.stdout.readline().split()
    return launcher, int(pid), asked


@pytest.mark.parametrize("how", ["end_with_launcher", "end_with_parent"])
def test_a_launcher_killed_outright_takes_its_child_with_it(how, tmp_path):
    marker = str(tmp_path / "marker")
    launcher, child, asked = _start_launcher(how, marker)
    try:
        assert asked == "True"
        assert child in gone(marker, timeout=0.5)  # Alive while its launcher is.
        launcher.kill()  # SIGKILL: the launcher ends nothing itself.
        launcher.wait(timeout=10)
        assert gone(marker, timeout=10) == []
    finally:
        for pid in gone(marker, timeout=0):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


def test_a_process_whose_launcher_is_already_gone_ends_at_once(tmp_path):
    # Named as launched by a process that is not its parent (its launcher
    # ended before the request was made): it ends before running anything.
    env = dict(os.environ, **{parent_death.LAUNCHER_PID_ENV: str(os.getpid() + 1)})
    began = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, "end_with_launcher", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert child.stdout == ""
    assert time.monotonic() - began < 30


def test_a_process_no_launcher_of_ours_started_is_left_alone():
    environ = {
        k: v for k, v in os.environ.items() if k != parent_death.LAUNCHER_PID_ENV
    }
    assert parent_death.end_with_launcher(environ) is False


def test_the_launcher_names_itself():
    env = parent_death.mark_launcher({})
    assert env == {parent_death.LAUNCHER_PID_ENV: str(os.getpid())}
