"""The everyday `fit` surface on the suite's backend, compared with one device.

Every case of `tests/fit_features.py` runs in every column of this backend
(JAX: DataParallel over 8 simulated devices and ModelParallel over a
`(4, 2)` mesh; torch: DataParallel over 2 gloo ranks and ModelParallel over
a `(2, 2)` mesh of 4; TensorFlow: DataParallel over 2 of conftest's 4
logical CPU devices, all 4 where Keras lists the devices itself),
through both doors, and must give one device's results: the weights, every
History (same keys, same lengths), `evaluate`'s logs, the predictions and
what the case's own training returned, within the case's `rtol` (1e-5
unless the case says why not). Equal results do not prove distribution, so
the probe first in every model must also have seen each global batch split
over the column's devices (`split_probe.assert_divided`).

JAX and TensorFlow run in this process. torch runs every case of a column in
one shared `keras_parallel.launch` (2 ranks, then 4), a hard timeout on
each; every rank's results are compared. A column a case does not apply to
is a skip with the reason docs/features.md shows; where the reason is
Keras's own (it refuses on one device too), a test checks that it still
does.
"""

import functools
import pathlib
import re

import fit_features
import keras
import numpy as np
import pytest
import split_probe
from builders import max_relative_difference
from fit_features import CASES, COLUMN_IDS, DOORS

BACKEND = keras.backend.backend()
COLUMNS = [column for column in COLUMN_IDS if column.split("-")[0] == BACKEND]
#: Seconds one torch launch may take (every case of a column, both doors).
TORCH_LAUNCH_TIMEOUT = 400
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "features.md"


def _params():
    params = []
    for name in CASES:
        for column in COLUMNS:
            for door in DOORS:
                params.append(
                    pytest.param(name, column, door, id=f"{column}-{door}-{name}")
                )
    return params


def _skip_reason(case, column, door):
    limit = case.limit(column)
    if limit is not None:
        return limit.reason
    if door not in case.doors:
        return case.door_note
    if door == "callback" and case.step_only:
        return fit_features.STEP_ONLY
    if door == "callback" and column.endswith("-model"):
        return fit_features.MODEL_COLUMN_DOOR
    return None


def _missing(case):
    if case.needs is None:
        return False
    import importlib.util

    return importlib.util.find_spec(case.needs) is None


@functools.cache
def reference(name):
    """Case `name` on one device, in plain Keras (once per module)."""
    return fit_features.run(name)


# ------------------------------------------------------------ comparison
def _close(actual, expected, rtol, what):
    # The same dtype: a distributed run that ignored the dtype policy
    # (mixed precision) would not pass as one that rounded alike.
    assert np.asarray(actual).dtype == np.asarray(expected).dtype, (
        what,
        np.asarray(actual).dtype,
        np.asarray(expected).dtype,
    )
    actual = np.asarray(actual, dtype="float64")
    expected = np.asarray(expected, dtype="float64")
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    # Relative to the largest value: a prediction near 0 is not held to
    # 1e-5 of itself.
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-6)
    worst = float(np.max(np.abs(actual - expected), initial=0.0)) / scale
    assert worst <= rtol, f"{what}: {worst:.3g} relative to {scale:.3g} (rtol {rtol})"


def _same_logs(actual, expected, rtol, what):
    """Dicts of floats or lists of floats: the same keys, lengths, values."""
    assert set(actual) == set(expected), (what, sorted(actual), sorted(expected))
    for key, value in expected.items():
        mine = actual[key]
        if isinstance(value, list):
            assert len(mine) == len(value), (f"{what}[{key!r}]", mine, value)
        np.testing.assert_allclose(
            mine, value, rtol=rtol, atol=1e-7, err_msg=f"{what}[{key!r}]"
        )


def _same_structure(actual, expected, rtol, what):
    if isinstance(expected, dict):
        assert set(actual) == set(expected), (what, sorted(actual), sorted(expected))
        for key in expected:
            _same_structure(actual[key], expected[key], rtol, f"{what}[{key!r}]")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), (what, len(actual), len(expected))
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _same_structure(a, e, rtol, f"{what}[{i}]")
    else:
        _close(actual, expected, rtol, what)


def _split_records(column, recorded):
    """The probe's records that must show a split.

    torch ModelParallel computes a batch its data axis does not divide (the
    epoch's last, 11 rows over 2; 13 rows of `validation_data`) whole on
    every rank, as docs/torch.md says ("Uneven batches"; in evaluation,
    with a layout that splits a variable along the batch axis, padded to a
    multiple of the mesh first). Those short batches are left out here,
    and only there.
    """
    if column != "torch-model":
        return recorded
    return [
        (rows, held)
        for rows, held in recorded
        if not (rows is not None and rows < fit_features.BATCH and held == rows)
    ]


def assert_equals_one_device(case, column, result, expected):
    """Every number of `result` is one device's, and the batches were split."""
    split_probe.assert_divided(
        _split_records(column, result["split"]),
        fit_features.BATCH,
        fit_features.ways(column, case.keras_defaults),
        # JAX on a mesh with a second axis computes a batch its data axis
        # does not divide whole (docs/jax.md); so may a case that says why.
        uneven_whole=column == "jax-model" or column in case.uneven_whole,
    )
    rtol = case.rtol
    difference = max_relative_difference(result["weights"], expected["weights"])
    assert difference <= rtol, (
        f"weights differ from one device's by {difference:.3g} (rtol {rtol})"
    )
    histories = result["histories"]
    assert len(histories) == len(expected["histories"]), "fit calls"
    for i, (mine, theirs) in enumerate(
        zip(histories, expected["histories"], strict=True)
    ):
        _same_logs(mine, theirs, rtol, f"History {i}")
    _same_logs(result["evaluation"], expected["evaluation"], rtol, "evaluate")
    _same_structure(result["predictions"], expected["predictions"], rtol, "predict")
    _same_structure(result["extra"], expected["extra"], rtol, "extra")
    # Last, so that a failing get_weights() hides no other difference.
    assert result["get_weights_error"] is None, (
        f"model.get_weights() after fit raised {result['get_weights_error']}"
    )


# ------------------------------------------------- JAX, TensorFlow: here
def _distributed_here(column):
    return column.split("-")[0] in ("jax", "tensorflow")


@pytest.mark.parametrize("name,column,door", _params())
def test_feature_equals_one_device(name, column, door, request):
    case = CASES[name]
    reason = _skip_reason(case, column, door)
    if reason is not None:
        pytest.skip(reason)
    if _missing(case):
        pytest.skip(f"needs {case.needs}, not installed in this environment")
    if _distributed_here(column):
        results = [fit_features.run(name, column, door)]
    else:
        results = request.getfixturevalue("torch_results")[(name, column, door)]
    expected = reference(case.reference or name)
    for rank, result in enumerate(results):
        if "error" in result:
            pytest.fail(f"rank {rank} raised:\n{result['error']}", pytrace=False)
        try:
            assert_equals_one_device(case, column, result, expected)
        except AssertionError as error:
            where = f"rank {rank} of {len(results)}: " if len(results) > 1 else ""
            raise AssertionError(f"{where}{error}") from None


@pytest.mark.parametrize("name", list(CASES))
def test_one_device_reference_trains(name):
    # Equality with one device means something only if training moved the
    # weights: a distribution that trained nothing must not pass.
    case = CASES[name]
    if not COLUMNS or all(case.limit(column) for column in COLUMNS):
        pytest.skip(f"{name} runs in no column of {BACKEND}")
    if _missing(case):
        pytest.skip(f"needs {case.needs}, not installed in this environment")
    expected = reference(case.reference or name)
    if expected["initial"] is not None:
        moved = max_relative_difference(expected["weights"], expected["initial"])
        assert moved > 1e-3, f"training moved the weights by {moved:.3g} only"
    if name == "plateau_early_stopping":
        # The decisions compared above exist: the rate was cut, and the run
        # stopped before its 8 epochs.
        history = expected["histories"][0]
        assert len(history["loss"]) < 8, history
        assert len(set(history["learning_rate"])) > 1, history
    if name in ("clipnorm", "global_clipnorm"):
        unclipped = reference("baseline")
        difference = max_relative_difference(expected["weights"], unclipped["weights"])
        assert difference > 1e-2, "the clipping never clipped"


# ------------------------------------------------------ Keras's own limits
def _keras_limits():
    return [
        pytest.param(name, column, id=f"{column}-{name}")
        for name, case in CASES.items()
        for column in COLUMNS
        if case.limit(column) is not None and case.limit(column).keras
    ]


@pytest.mark.parametrize("name,column", _keras_limits() or [pytest.param(None, None)])
def test_keras_itself_refuses_on_one_device(name, column):
    # The docs say "Keras cannot"; that stays true only while it refuses.
    if name is None:
        pytest.skip(f"no case is refused by Keras itself on {BACKEND}")
    limit = CASES[name].limit(column)
    with pytest.raises(ValueError, match=limit.match):
        fit_features.run(name)


# ------------------------------------------------------------ torch: ranks
@pytest.fixture(scope="module")
def torch_results():
    """Every torch case's per-rank results, launched once per module."""
    return launch_torch_columns()


def launch_torch_columns():
    """`{(name, column, door): [rank 0's result, ...]}`, one launch per column."""
    from torch_launch import launch

    out = {}
    for column in COLUMNS:
        selected = [
            (name, column, door)
            for name, case in CASES.items()
            for door in DOORS
            if _skip_reason(case, column, door) is None and not _missing(case)
        ]
        per_rank = launch(
            fit_features.torch_run,
            fit_features.TORCH_PROCESSES[column],
            args=(selected,),
            timeout=TORCH_LAUNCH_TIMEOUT,
            collective_timeout=60,
        )
        for i, key in enumerate(selected):
            out[key] = [rank[i] for rank in per_rank]
    return out


# -------------------------------------------------------------- the docs
BEGIN = "<!-- features-table: begin (python tests/fit_features.py) -->"
END = "<!-- features-table: end -->"


def test_docs_table_is_the_case_table():
    text = DOCS.read_text()
    found = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert found, f"docs/features.md has no table between {BEGIN!r} and {END!r}"
    assert found.group(1) == fit_features.features_table(), (
        "docs/features.md's table is not tests/fit_features.py's: regenerate "
        "it with `python tests/fit_features.py`"
    )


def test_every_case_says_why_it_is_left_out():
    for name, case in CASES.items():
        assert set(case.limits) <= set(COLUMN_IDS), name
        for limit in case.limits.values():
            assert limit.reason, name
        assert set(case.doors) <= set(DOORS) and case.doors, name
        assert case.doors == DOORS or case.door_note, name
        assert case.rtol == 1e-5 or case.why_rtol, name
        assert set(case.uneven_whole) <= set(COLUMN_IDS), name
        assert all(case.uneven_whole.values()), name
