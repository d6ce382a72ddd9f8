"""Keras's own tests, every `fit`, `evaluate` and `predict` through a door.

Keras's source distribution on the package registry holds its test files
(`keras/src/**/*_test.py`). This script takes those of the installed Keras
version (downloaded once into `.keras_own/`), and runs them with pytest,
each entry point sent through keras_parallel:

- `--door callback`: `ShardingCallback(DataParallel())` appended to every
  `fit`, `evaluate` and `predict` call's callbacks;
- `--door model`: every model compiled as a `DistributedModel` (its class
  made a subclass with `DistributedModel` first, as `class Net(
  keras_parallel.DistributedModel, keras.Model)` is) with
  `distribution=DataParallel()`;
- `--door none`: Keras's tests as they are (the reference count).

It prints pytest's summary and one line of counts. A net for changes of
keras_parallel's run lifecycle: compare the counts before and after.

Usage (in one process, the backend's devices; on JAX set
`XLA_FLAGS=--xla_force_host_platform_device_count=8` first):

    KERAS_BACKEND=jax python tools/keras_own_tests.py --door callback
    tox -e keras-own-jax            # both doors and the reference
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

#: Keras's test files run by default: its trainer, models and callbacks.
DEFAULT_FILES = (
    "keras/src/trainers/trainer_test.py",
    "keras/src/models/model_test.py",
    "keras/src/models/sequential_test.py",
    "keras/src/models/functional_test.py",
    "keras/src/callbacks/callback_test.py",
    "keras/src/callbacks/early_stopping_test.py",
    "keras/src/callbacks/model_checkpoint_test.py",
    "keras/src/callbacks/backup_and_restore_test.py",
    "keras/src/callbacks/reduce_lr_on_plateau_test.py",
    "keras/src/callbacks/learning_rate_scheduler_test.py",
    "keras/src/callbacks/lambda_callback_test.py",
    "keras/src/callbacks/csv_logger_test.py",
    "keras/src/callbacks/terminate_on_nan_test.py",
)

CONFTEST = '''"""Written by tools/keras_own_tests.py: markers Keras's own conftest
defines, and the door every entry point goes through."""

import functools
import os

import pytest


def pytest_configure(config):
    for marker in ("requires_trainable_backend", "large", "skip_if_backend"):
        config.addinivalue_line("markers", marker)


#: Keras's tests that cannot pass on every rank of a launch, and why: run
#: on several ranks, one failing alone leaves it ahead in its collectives.
NOT_ON_SEVERAL_RANKS = {
    ("model_checkpoint_test.py", "test_model_checkpoint_options"): (
        "each rank removes the checkpoint (os.remove) once it has checked it: "
        "the other ranks, given the same path, may find it gone"
    ),
    ("csv_logger_test.py", "test_CSVLogger"): (
        "each rank removes the log (os.remove) once it has read it: the "
        "other ranks, given the same path, may find it gone"
    ),
}


def pytest_collection_modifyitems(config, items):
    import keras

    if keras.backend.backend() == "numpy":
        skip = pytest.mark.skip(reason="Trainer not implemented for NumPy")
        for item in items:
            if "requires_trainable_backend" in item.keywords:
                item.add_marker(skip)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        for item in items:
            why = NOT_ON_SEVERAL_RANKS.get((item.path.name, item.name))
            if why:
                item.add_marker(pytest.mark.skip(reason=f"several ranks: {why}"))


DOOR = os.environ["KERAS_OWN_DOOR"]
#: Entry points sent through the door (callback) or models compiled through
#: it (model): proof that the door was in force.
THROUGH = [0]


def pytest_terminal_summary(terminalreporter):
    import json

    counts = {
        kind: len(terminalreporter.stats.get(kind, []))
        for kind in ("passed", "failed", "error", "skipped")
    }
    counts["through the door"] = THROUGH[0]
    rank = os.environ.get("RANK", "0")
    with open(f"keras_own.{rank}.json", "w") as f:
        json.dump(counts, f)


def pytest_runtest_logreport(report):
    # One line per test and phase, per rank, written as it happens: where
    # two ranks' logs first differ is where their collectives part ways.
    if report.when == "call" or report.outcome != "passed":
        rank = os.environ.get("RANK", "0")
        with open(f"keras_own.{rank}.log", "a") as f:
            f.write(f"{report.nodeid} {report.when} {report.outcome}\\n")
        if report.failed:  # At once: a rank may never reach pytest's summary.
            with open(f"keras_own.{rank}.failures", "a") as f:
                f.write(f"{report.nodeid}\\n{report.longreprtext}\\n\\n")


def _install():
    import keras

    import keras_parallel

    if DOOR == "callback":

        def through_callback(method):
            @functools.wraps(method)
            def run(self, *args, callbacks=None, **kwargs):
                if not isinstance(callbacks, keras.callbacks.CallbackList):
                    callbacks = list(callbacks or [])
                    if not any(
                        isinstance(c, keras_parallel.ShardingCallback)
                        for c in callbacks
                    ):
                        THROUGH[0] += 1
                        callbacks.append(
                            keras_parallel.ShardingCallback(
                                keras_parallel.DataParallel()
                            )
                        )
                return method(self, *args, callbacks=callbacks, **kwargs)

            return run

        for name in ("fit", "evaluate", "predict"):
            setattr(keras.Model, name, through_callback(getattr(keras.Model, name)))
    elif DOOR == "model":
        keras_compile = keras.Model.compile
        made = {}

        def compile(self, *args, **kwargs):
            if isinstance(self, keras_parallel.DistributedModel):
                return keras_compile(self, *args, **kwargs)
            cls = type(self)
            if cls not in made:
                made[cls] = type(
                    cls.__name__,
                    (keras_parallel.DistributedModel, cls),
                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
                )
            object.__setattr__(self, "__class__", made[cls])
            THROUGH[0] += 1
            kwargs.setdefault("distribution", keras_parallel.DataParallel())
            return keras_parallel.DistributedModel.compile(self, *args, **kwargs)

        keras.Model.compile = compile


def _same_temp_dirs(base):
    """Every rank of a launch is given the same folders, one per call.

    One `fit` on many processes is given one path on all of them; Keras's
    tests make a random folder per process (`get_temp_dir`,
    `tempfile.TemporaryDirectory`), so only the chief's rank would find the
    files the chief writes. Here the n-th folder a test asks for is
    `<base>/<test>/<n>` on every rank. The folders outlive the test (the tool
    removes them): a rank done with a test must not delete what another
    rank still reads. Only a test's own calls are served so: Keras's code
    may make folders on the chief alone.
    """
    import re
    import sys
    import tempfile

    from keras.src.testing import test_case

    def shared_folder():
        test = re.sub(r"[^A-Za-z0-9_.-]", "_", CURRENT[0])
        CURRENT[1] += 1
        path = os.path.join(base, test, str(CURRENT[1]))
        os.makedirs(path, exist_ok=True)
        return path

    class TemporaryDirectory(tempfile.TemporaryDirectory):
        def __init__(self, *args, **kwargs):
            self.shared = sys._getframe(1).f_code.co_filename.endswith("_test.py")
            if self.shared:
                self.name = shared_folder()
            else:
                super().__init__(*args, **kwargs)

        def cleanup(self):
            if not self.shared:
                super().cleanup()

    test_case.TestCase.get_temp_dir = lambda self: shared_folder()
    tempfile.TemporaryDirectory = TemporaryDirectory


#: The test running and how many folders it has been given.
CURRENT = ["", 0]


def pytest_runtest_setup(item):
    CURRENT[:] = [item.nodeid, 0]


if DOOR != "none":
    _install()
if os.environ.get("KERAS_OWN_TEMP"):
    _same_temp_dirs(os.environ["KERAS_OWN_TEMP"])
'''


def _sdist(version, cache):
    """The folder of Keras `version`'s source distribution, extracted."""
    folder = cache / f"keras-{version}"
    if folder.is_dir():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps",
            "--no-binary", ":all:", f"keras=={version}", "-d", str(cache),
        ],
        check=True,
    )  # fmt: skip
    archive = cache / f"keras-{version}.tar.gz"
    with tarfile.open(archive) as tar:
        members = [
            m for m in tar.getmembers() if m.name.endswith("_test.py") and m.isfile()
        ]
        tar.extractall(cache, members=members, filter="data")
    return folder


def _first_divergence(run_dir, nproc):
    """Where the ranks' test outcomes first differ, in words; None if nowhere.

    A Keras test that fails on one rank only (a path or a count that differs
    by rank) leaves that rank ahead in its collectives: every later test may
    then hang or fail on every rank. The first line that differs names it.
    """
    logs = []
    for rank in range(nproc):
        log = run_dir / f"keras_own.{rank}.log"
        logs.append(log.read_text().splitlines() if log.exists() else [])
    for index, lines in enumerate(zip(*logs, strict=False)):
        if len(set(lines)) > 1:
            return f"The ranks part at test {index + 1}: " + "; ".join(
                f"rank {rank}: {line}" for rank, line in enumerate(lines)
            )
    lengths = [len(lines) for lines in logs]
    if len(set(lengths)) > 1:
        return f"The ranks ran different numbers of tests: {lengths}."
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--door", choices=("callback", "model", "none"), default="callback"
    )
    parser.add_argument("--files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--cache", default=".keras_own")
    parser.add_argument("--nproc", type=int, default=1, help="torch ranks")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's own")
    args = parser.parse_args(argv)
    import keras

    version = keras.version()
    folder = _sdist(version, pathlib.Path(args.cache).resolve())
    # A folder of their own: Keras's tests import `keras` from the installed
    # package, not from the extracted files (which hold the tests alone).
    run_dir = folder / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "conftest.py").write_text(CONFTEST)
    files = [str(folder / f) for f in args.files if (folder / f).is_file()]
    # The door's plugin first; a PYTHONPATH given (another checkout) kept.
    path = os.pathsep.join(p for p in (str(run_dir), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, KERAS_OWN_DOOR=args.door, PYTHONPATH=path)
    temp = run_dir / "temp"
    shutil.rmtree(temp, ignore_errors=True)
    if args.nproc > 1:
        env["KERAS_OWN_TEMP"] = str(temp)
    command = [sys.executable, "-m", "pytest"]
    if args.nproc > 1:  # torch: every rank runs the same tests, in order.
        command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
        command += ["--backend", "torch", "--nproc", str(args.nproc), "-m", "pytest"]
    command += ["-q", "-p", "no:cacheprovider"]
    # The door's plugin by name, from `run_dir` (not above the tests).
    command += ["--rootdir", str(run_dir), "-c", os.devnull, "-p", "conftest"]
    command += files + args.pytest_args
    for old in [
        *run_dir.glob("keras_own.*.json"),
        *run_dir.glob("keras_own.*.log*"),
        *run_dir.glob("keras_own.*.failures"),
    ]:
        old.unlink()
    result = subprocess.run(
        command, cwd=run_dir, env=env, text=True, capture_output=True
    )
    # The whole of both streams kept beside the tests; their ends printed.
    (run_dir / "keras_own.out").write_text(result.stdout + result.stderr)
    print(result.stdout[-20000:])
    print(result.stderr[-5000:], file=sys.stderr)
    print(f"All of pytest's output: {run_dir / 'keras_own.out'}", file=sys.stderr)
    divergence = _first_divergence(run_dir, args.nproc)
    if divergence:
        print(divergence, file=sys.stderr)
    report = run_dir / "keras_own.0.json"
    counts = json.loads(report.read_text()) if report.exists() else "no report"
    print(
        f"keras {version}, backend {keras.backend.backend()}, door {args.door}, "
        f"{args.nproc} process(es): {counts}"
    )
    return 0 if report.exists() else 1


if __name__ == "__main__":
    sys.exit(main())
