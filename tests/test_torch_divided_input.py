"""Each torch rank prepares only its rows of every global batch.

Two ranks fit, validate, evaluate and predict through arrays and a torch
`DataLoader` over a map-style dataset (shuffled, uneven last batch): the
rows each rank's pipeline prepared are about half of one device's, and the
weights, History, evaluation and predictions equal one process's, the
split proven by the rows each rank's steps computed.
"""

import divided_input_workers as workers
import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch ranks"
)

CASES = {
    "arrays": dict(kind="arrays"),
    "dataloader": dict(kind="dataloader"),
    "dataloader_workers": dict(kind="dataloader", num_workers=2),
}


@pytest.fixture(scope="module")
def two_ranks():
    from keras_parallel.launcher.torch_processes import launch

    names = list(CASES)
    results = launch(
        workers.run_all,
        2,
        args=([CASES[name] for name in names],),
        timeout=300,
        collective_timeout=60,
    )
    return {name: [rank[i] for rank in results] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def one_process():
    return {
        name: workers.run(**dict(case, distributed=False))
        for name, case in CASES.items()
    }


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_train_as_one_process(two_ranks, one_process, name):
    reference = one_process[name]
    for result in two_ranks[name]:
        for a, b in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        for key, values in reference["history"].items():
            np.testing.assert_allclose(result["history"][key], values, rtol=1e-5)
        for key, value in reference["evaluation"].items():
            np.testing.assert_allclose(result["evaluation"][key], value, rtol=1e-5)
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], rtol=1e-5, atol=1e-6
        )
        # The split: each step of this rank computed its half (32 of 64;
        # 22 or 21 of the last 43; 23 or 22 of validation's last 45).
        rows = {r for _, r in result["split"]}
        assert rows <= {32, 23, 22, 21} and 32 in rows, result["split"]


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_divides_its_input(two_ranks, name):
    kind = CASES[name]["kind"]
    kinds = {"arrays": "arrays", "dataloader": "DataLoader"}
    for result in two_ranks[name]:
        # Evaluate and predict read arrays after a DataLoader's fit.
        assert result["divided"][kinds[kind]] is True, result["divided"]
        assert all(result["divided"].values()), result["divided"]


def test_each_rank_loads_about_half_the_rows(two_ranks, one_process):
    from keras_parallel.backends.torch.batches import split_rows

    alone = one_process["dataloader"]["loaded"]
    # 2 epochs of 1003 rows and their validation (301 rows each), and the
    # batch Keras draws first to build the loss and metrics.
    batches = [64] * 15 + [43] + [64] * 4 + [45]
    assert alone == 2 * sum(batches) + 64
    for rank, result in enumerate(two_ranks["dataloader"]):
        # Its rows of each global batch (22 and 21 of 43), and that first
        # batch: at most half an epoch and one batch.
        share = sum(
            stop - start for start, stop, _ in (split_rows(b, 2, rank) for b in batches)
        )
        assert result["loaded"] == 2 * share + 64
        assert result["loaded"] <= alone / 2 + 64
