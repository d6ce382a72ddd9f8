"""`benchmarks/gpu_check.py` runs on CPU (`--dry-run`): the script a lent
GPU runs is ready, its torch part on a process group of one that takes the
whole distributed path (`KERAS_PARALLEL_ONE_PROCESS_GROUP`)."""

import os
import sys

import pytest
from subprocesses import checkout_env, run_in_session

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "benchmarks", "gpu_check.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def dry_run():
    if os.environ.get("KERAS_BACKEND") != "jax":
        # The script runs torch and JAX itself, whatever the suite's backend:
        # one env runs it (about 19 s a run).
        pytest.skip("backend-neutral: run in the jax env")
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    result = run_in_session(
        [sys.executable, SCRIPT, "--dry-run"], checkout_env(), timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout


def _rows(table):
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] in ("torch", "jax"):
            rows[tuple(cells[:3])] = cells[3]
    return rows


def test_the_dry_run_prints_every_backend_and_way(dry_run):
    rows = _rows(dry_run)
    for backend in ("torch", "jax"):
        for model in ("small", "medium"):
            for way in ("keras fit", "keras_parallel fit", "hand loop"):
                assert float(rows[(backend, model, way)]) > 0, (backend, model, way)
    assert "FAILED" not in dry_run


def test_torch_runs_every_collective_and_ddp_on_a_group_of_one(dry_run):
    rows = _rows(dry_run)
    collectives = {
        k[2]: v for k, v in rows.items() if k[:2] == ("torch", "collectives")
    }
    assert set(collectives) >= {
        "reduce (float)",
        "broadcast",
        "barrier",
        "key-value store",
    }
    assert set(collectives.values()) == {"ok"}, collectives
    assert rows[("torch", "small", "DDP")] == "True"
    assert rows[("torch", "medium", "DDP")] == "True"


def test_a_failed_collective_fails_the_check():
    results = {"torch": {"collectives": {"reduce (float)": "ValueError: cpu tensor"}}}
    assert "| torch | collectives | reduce (float) | ValueError: cpu tensor |" in (
        gpu_check.table(results, "")
    )
