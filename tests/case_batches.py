"""Many multi-process cases in one launch, each with its own result.

Starting processes is most of a multi-process test's time (Python, Keras
and a backend imported in every process, the group joined), so the tests
run a batch of cases in one launch instead of one launch per case:

- In each launched process, `serve(out, cases, run_case)` runs the cases in
  order, each in its own folder `out/<case>`, marking it started and done
  per process (`started.<process>`, `done.<process>`). A case that raises
  leaves its traceback (`error.<process>.txt`) and ends the process: the
  group cannot go on past a collective another process never reached.
- In the test process, `run_batch(cases, launch, out)` launches them and
  reads the marks. The cases done are done; the first case not done has
  failed (its processes' tracebacks, or the launch's own error: a crash, a
  hang past the timeout); the ones after it are launched again, without
  it. A case that raises or hangs fails alone, with its name, and the
  others still run.

What crosses to the processes is data: the cases' names, on the command
line or as arguments.
"""

import dataclasses
import os
import traceback

#: The marks a process leaves for a case, in the batch's `marks/` folder.
STARTED = "{}.started.{}"
DONE = "{}.done.{}"
ERROR = "{}.error.{}.txt"
MARKS = "marks"


def serve(out, cases, run_case, process):
    """Runs each case's `run_case(folder, case)` in order, marking each one.

    Args:
        out: the batch's folder (every process of the launch shares it).
        cases: the cases' names, in order.
        run_case: `run_case(folder, case)`, this process's part of a case.
        process: this process's index (rank).

    Raises:
        Exception: a case's own, after its traceback was written: the
            processes of the launch end, and the test process launches the
            cases after it again.
    """
    marks = os.path.join(out, MARKS)
    os.makedirs(marks, exist_ok=True)
    for case in cases:
        folder = os.path.join(out, case)
        os.makedirs(folder, exist_ok=True)
        _mark(marks, STARTED.format(case, process))
        try:
            run_case(folder, case)
        except BaseException:
            _mark(marks, ERROR.format(case, process), traceback.format_exc())
            raise
        _mark(marks, DONE.format(case, process))


def _mark(marks, name, text=""):
    with open(os.path.join(marks, name), "w") as f:
        f.write(text)


def _marked(out, name):
    return os.path.exists(os.path.join(out, MARKS, name))


@dataclasses.dataclass
class Outcome:
    """One case of a batch: where its files are, and why it failed, if it did."""

    case: str
    folder: str
    error: str | None = None

    def check(self):
        """Fails the calling test with the case's error, if it has one."""
        if self.error is not None:
            import pytest

            pytest.fail(f"case {self.case!r} failed:\n{self.error}", pytrace=False)
        return self.folder


def run_batch(cases, launch, out, processes):
    """Runs `cases` by `launch`, again without a case that failed.

    Args:
        cases: the cases' names, in order.
        launch: `launch(cases, out)`, which runs them in `processes`
            processes (each calling `serve`) and returns the launch's
            output (stdout and stderr, for a failure's report), raising
            or returning when they end.
        out: the batch's folder.
        processes: how many processes serve the cases.

    Returns:
        `{case: Outcome}` for every case.
    """
    outcomes = {}
    remaining = list(cases)
    while remaining:
        try:
            said = launch(remaining, out)
        except Exception as error:  # A timeout, a launch that raised.
            said = f"{type(error).__name__}: {error}"
        for case in list(remaining):
            folder = os.path.join(out, case)
            if all(_marked(out, DONE.format(case, p)) for p in range(processes)):
                outcomes[case] = Outcome(case, folder)
                remaining.remove(case)
                continue
            error = _failure(out, case, processes, said)
            outcomes[case] = Outcome(case, folder, error)
            remaining = remaining[remaining.index(case) + 1 :]
            break
    return outcomes


def _failure(out, case, processes, said):
    """What a case that was not done left: tracebacks, or the launch's output."""
    parts = []
    for process in range(processes):
        path = os.path.join(out, MARKS, ERROR.format(case, process))
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f"process {process} raised:\n{f.read()}")
    started = [p for p in range(processes) if _marked(out, STARTED.format(case, p))]
    if not parts:
        where = f"started on processes {started}" if started else "never started"
        parts.append(f"no process finished it ({where}); the launch said:")
    parts.append(str(said)[-4000:])
    return "\n".join(parts)
