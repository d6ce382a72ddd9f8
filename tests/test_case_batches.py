"""`case_batches`: a batch of cases in one launch, each failing alone.

Two plain Python processes serve the batch (no backend: the batching is
what is tested); a case that raises on one process, and one that hangs
past the launch's timeout, each fail with their name and what their
processes said, and every other case still runs, in order.
"""

import os
import subprocess
import sys
import time

import backend_neutral
from case_batches import run_batch, serve
from subprocesses import checkout_env, gone, run_in_session

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = backend_neutral.once


def run_case(folder, case):
    """A case's part in one process: writes `pid`, raises or hangs if named so."""
    process = int(os.environ["PROCESS"])
    if case == "raises" and process == 1:
        raise ValueError(f"case {case} raised on process {process}")
    if case == "hangs":
        time.sleep(600)
    with open(os.path.join(folder, f"pid{process}"), "w") as f:
        f.write(str(os.getpid()))


def launch(cases, out, timeout=5):
    """Both processes of a launch, in one shell of its own session."""
    code = (
        "import os, sys, test_case_batches as t, case_batches as b; "
        "b.serve(sys.argv[1], sys.argv[2].split(','), t.run_case, "
        "int(os.environ['PROCESS']))"
    )
    each = f'{sys.executable} -c "{code}" {out} {",".join(cases)}'
    shell = f"PROCESS=0 {each} & PROCESS=1 {each}; wait"
    try:
        result = run_in_session(["bash", "-c", shell], checkout_env(), timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the launch ran past {timeout} s") from None
    return result.stderr


def test_a_case_that_raises_or_hangs_fails_alone_and_the_rest_run(tmp_path):
    cases = ["first", "raises", "middle", "hangs", "last"]
    outcomes = run_batch(cases, launch, str(tmp_path), processes=2)
    assert list(outcomes) == cases
    for case in ("first", "middle", "last"):
        folder = outcomes[case].check()
        assert sorted(os.listdir(folder)) == ["pid0", "pid1"], case
    raised = outcomes["raises"].error
    assert "process 1 raised" in raised and "case raises raised on process 1" in raised
    hung = outcomes["hangs"].error
    assert "no process finished it (started on processes [0, 1])" in hung, hung
    assert "ran past 5 s" in hung
    assert gone(str(tmp_path)) == []


def test_serve_marks_each_case_per_process(tmp_path):
    os.environ["PROCESS"] = "0"
    try:
        serve(str(tmp_path), ["a", "b"], run_case, 0)
    finally:
        del os.environ["PROCESS"]
    assert sorted(os.listdir(tmp_path / "marks")) == [
        "a.done.0",
        "a.started.0",
        "b.done.0",
        "b.started.0",
    ]
