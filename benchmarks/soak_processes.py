"""The multi-process tests, many times in a row: no hang, no process left.

Runs the tests that start processes (launches, kills, restarts) `--runs`
times for one backend, each run under a hard timeout (the run and every
process it started killed on expiry), and counts after every run the
processes it started that still exist (found by a variable in their
environment; none may be left). Not part of CI: it takes `runs` times the
tests' own time.

Run it in a tox env of the backend, e.g.
`KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=8
.tox/jax/bin/python benchmarks/soak_processes.py --runs 20`.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = {
    "jax": [
        "tests/test_jax_processes.py",
        "tests/test_faults.py",
        "tests/test_orbax_checkpoint.py",
    ],
    "torch": [
        "tests/test_launcher.py",
        "tests/test_faults.py",
        "tests/test_torch_executor.py",
        "tests/test_torch_model_parallel.py",
    ],
    "tensorflow": ["tests/test_tensorflow_processes.py", "tests/test_faults.py"],
}
#: Set in each run's environment: every process the run starts inherits it,
#: so what is left after the run is found by it, whatever its name.
RUN_ENV = "KERAS_PARALLEL_SOAK_RUN"


def leftovers(run):
    """PIDs of processes started by soak run `run` that still exist."""
    marker = f"{RUN_ENV}={run}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--timeout", type=int, default=1200, help="s per run")
    parser.add_argument("--tests", nargs="+", help="test files (default: all)")
    args = parser.parse_args()
    backend = os.environ.get("KERAS_BACKEND", "jax")
    tests = args.tests or TESTS[backend]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += tests
    results = []
    for run in range(args.runs):
        start = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=dict(os.environ, **{RUN_ENV: str(run)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(timeout=args.timeout)
            outcome = "passed" if process.returncode == 0 else "FAILED"
            summary = out.strip().splitlines()[-1] if out.strip() else ""
            if outcome == "FAILED":
                # Kept for reading: which test, and why.
                with open(f"soak-run{run + 1}.log", "w") as f:
                    f.write(out)
                summary += f"; output in soak-run{run + 1}.log"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # The run and all it started.
            process.communicate()
            outcome, summary = "HUNG", f"over {args.timeout} s"
        time.sleep(2)  # Let processes that are ending end.
        left = leftovers(run)
        results.append((outcome, left))
        print(
            f"run {run + 1}/{args.runs}: {outcome} in "
            f"{time.monotonic() - start:.0f} s ({summary}); processes left: "
            f"{len(left)}",
            flush=True,
        )
    failed = sum(outcome == "FAILED" for outcome, _ in results)
    hung = sum(outcome == "HUNG" for outcome, _ in results)
    left = sum(len(pids) for _, pids in results)
    print(
        f"{backend}: {args.runs} runs of {' '.join(tests)}: "
        f"{args.runs - failed - hung} passed, {failed} failed, {hung} hung, "
        f"{left} processes left"
    )
    return 1 if failed or hung or left else 0


if __name__ == "__main__":
    sys.exit(main())
