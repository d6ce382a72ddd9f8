"""Where the suite's time goes: a pytest plugin, on when asked.

`KERAS_PARALLEL_SUITE_TIMING=<file.json>` in the tests' environment (tox
passes it through; `{env}` in the name becomes tox's env name) writes,
per test: its wall seconds (setup, call and
teardown together), the processes it started (`subprocess.Popen` and
`multiprocessing` starts, launchers and ranks alike, as seen from the
test's process), the CPU seconds of this process and of the processes it
waited for (a test whose CPU seconds are far below twice its wall seconds
on 2 cores is waiting: a deadline, a sleep, a poll), and, on JAX, the seconds this process spent tracing,
lowering and compiling (JAX's own monitoring events). `python
tests/suite_timing.py FILE...` prints them per test file, as
tests/README.md's table.
"""

import collections
import json
import os
import resource
import sys
import time

import pytest

VARIABLE = "KERAS_PARALLEL_SUITE_TIMING"
#: JAX's monitoring events of a compilation, in this process.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class SuiteTiming:
    """Per test: wall seconds, processes started, JAX compile seconds."""

    def __init__(self, path):
        self.path = path
        self.records = {}
        self._launches = 0
        self._compile_s = 0.0
        self._count_launches()

    def _count_launches(self):
        import multiprocessing.process
        import subprocess

        timing = self
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start

        def counted_init(self, *args, **kwargs):
            timing._launches += 1
            popen_init(self, *args, **kwargs)

        def counted_start(self):
            timing._launches += 1
            process_start(self)

        subprocess.Popen.__init__ = counted_init
        multiprocessing.process.BaseProcess.start = counted_start

    def _listen_to_jax(self):
        if "jax" not in sys.modules or getattr(self, "_listening", False):
            return
        import jax

        def on_duration(event, duration, **kwargs):
            if event in _COMPILE_EVENTS:
                self._compile_s += duration

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        self._listening = True

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._listen_to_jax()
        launches, compile_s = self._launches, self._compile_s
        began, cpu = time.monotonic(), _cpu_seconds()
        yield
        self.records[item.nodeid] = {
            "seconds": round(time.monotonic() - began, 3),
            "cpu_seconds": round(_cpu_seconds() - cpu, 3),
            "launches": self._launches - launches,
            "jax_compile_seconds": round(self._compile_s - compile_s, 3),
        }

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump(self.records, f, indent=1, sort_keys=True)


def _cpu_seconds():
    """User and system CPU of this process and its waited-for children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def register(config):
    """Adds the plugin when `KERAS_PARALLEL_SUITE_TIMING` names a file."""
    path = os.environ.get(VARIABLE)
    if path:
        # `{env}`: tox's env name, one file per env of a whole matrix
        # (`KERAS_PARALLEL_SUITE_TIMING=/tmp/timing-{env}.json .ci/run`).
        path = path.replace("{env}", os.environ.get("TOX_ENV_NAME", "pytest"))
        config.pluginmanager.register(SuiteTiming(path), "suite_timing")


def summarize(paths):
    """Rows `(file, tests, seconds, cpu s, launches, jax compile s)`, slowest
    first."""
    per_file = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0.0])
    for path in paths:
        with open(path) as f:
            for nodeid, record in json.load(f).items():
                row = per_file[nodeid.split("::")[0]]
                row[0] += 1
                row[1] += record["seconds"]
                row[2] += record.get("cpu_seconds", 0.0)
                row[3] += record["launches"]
                row[4] += record["jax_compile_seconds"]
    rows = [(name, *values) for name, values in per_file.items()]
    return sorted(rows, key=lambda row: -row[2])


def main(paths):
    rows = summarize(paths)
    total = sum(row[2] for row in rows)
    print(
        "| file | tests | seconds | share | CPU s | processes started | JAX compile s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, tests, seconds, cpu, launches, compile_s in rows:
        share = 100 * seconds / total if total else 0.0
        print(
            f"| {name} | {tests} | {seconds:.0f} | {share:.0f} % | {cpu:.0f} "
            f"| {launches} | {compile_s:.0f} |"
        )
    print(
        f"| total | {sum(r[1] for r in rows)} | {total:.0f} | | "
        f"{sum(r[3] for r in rows):.0f} | {sum(r[4] for r in rows)} "
        f"| {sum(r[5] for r in rows):.0f} |"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
