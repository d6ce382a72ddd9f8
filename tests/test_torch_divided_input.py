"""Each torch rank prepares only its rows of every global batch.

Two ranks fit, validate, evaluate and predict through arrays, a torch
`DataLoader` over a map-style dataset (shuffled, uneven last batch), a
`PyDataset`, a generator and a `tf.data` pipeline with a map: the
rows each rank's pipeline prepared are about half of one device's, and the
weights, History, evaluation and predictions equal one process's, the
split proven by the rows each rank's steps computed.
"""

import divided_input_workers as workers
import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch ranks"
)

CASES = {
    "arrays": dict(kind="arrays"),
    "dataloader": dict(kind="dataloader"),
    "dataloader_workers": dict(kind="dataloader", num_workers=2),
    "pydataset": dict(kind="pydataset"),
    # Several workers: Keras's own enqueuer, read whole by every rank.
    "pydataset_workers": dict(kind="pydataset", num_workers=2, shuffle=False),
    "generator": dict(kind="generator"),
    "tfdata": dict(kind="tfdata"),
}


@pytest.fixture(scope="module")
def two_ranks():
    from torch_launch import launch

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
        workers.assert_trained_as_one_device(result, reference)
        # The split: each step of this rank computed its half (32 of 64;
        # 22 or 21 of the last 43; validation's batches of 64, or of 32
        # where fit has no batch_size: 23 or 22 of 45, 16, 7 or 6 of 13).
        rows = {r for _, r in result["split"]}
        assert rows <= {32, 23, 22, 21, 16, 7, 6} and 32 in rows, result["split"]


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_divides_its_input(two_ranks, name):
    kind = CASES[name]["kind"]
    kinds = {
        "arrays": "arrays",
        "dataloader": "DataLoader",
        "pydataset": "PyDataset",
        "generator": "generator",
        "tfdata": "tf.data",
    }
    divided = name != "pydataset_workers"
    for result in two_ranks[name]:
        assert result["divided"][kinds[kind]] is divided, result["divided"]
        # Validation reads arrays after a PyDataset's or generator's fit.
        assert set(result["divided"]) <= {kinds[kind], "arrays"}
        assert result["divided"].get("arrays", True) is True


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


def test_each_rank_makes_half_a_pydatasets_batches(two_ranks, one_process):
    alone = one_process["pydataset"]["loaded"]
    # Keras makes the first batch to build the loss and metrics, then 2
    # epochs of 16 batches (1003 rows) in a shuffled order.
    assert alone == 64 + 2 * 1003
    made = [r["loaded"] for r in two_ranks["pydataset"]]
    for rank_made in made:
        # Every other batch of each epoch, and that first batch: at most
        # half the epochs and one batch.
        assert rank_made <= 64 + 1003 + 64, made
    assert sum(made) == 2 * 64 + 2 * 1003  # Each batch made once.


def test_one_rank_draws_the_generator(two_ranks, one_process):
    alone = one_process["generator"]["loaded"]
    assert alone == 2 * 1003  # 2 epochs of 16 steps: 15 batches of 64, 43.
    drawn = [r["loaded"] for r in two_ranks["generator"]]
    # Rank 0 draws what one process draws; rank 1 only the 2 batches Keras
    # peeks when fit starts (for the data's shapes), never trained on.
    assert drawn == [alone, 2 * 64], drawn


def test_each_rank_maps_about_half_a_tf_data_pipelines_rows(two_ranks, one_process):
    alone = one_process["tfdata"]["loaded"]
    every_row = 2 * (1003 + 301)  # 2 epochs of 1003 rows and of 301 to validate.
    # Beyond its rows, each iterator (Keras's first look at the data, and
    # each epoch's) may map what `prefetch(2)` and the map in progress hold
    # when it is dropped: CI saw 3.5 batches in all, so allow 6.
    slack = 6 * 64
    assert every_row <= alone <= every_row + slack
    mapped = [r["loaded"] for r in two_ranks["tfdata"]]
    for rank_mapped in mapped:
        # Its rows of each global batch (22 or 21 of 43) and the same slack:
        # at most 1688, where a rank mapping every row maps at least 2608.
        assert rank_mapped <= every_row / 2 + slack, mapped


def test_a_rank_whose_pipeline_raises_is_the_one_reported():
    from torch_launch import launch

    with pytest.raises(RuntimeError, match="batch 3 could not be decoded") as raised:
        launch(workers.pipeline_fails_on_rank_1, 2, timeout=120, collective_timeout=30)
    assert raised.value.rank == 1


# A loader's worker processes count in their own copies: not here.
COUNTED_AFTER_FIT = [n for n in CASES if n not in ("arrays", "pydataset_workers")]
COUNTED_AFTER_FIT.remove("dataloader_workers")


@pytest.mark.parametrize("name", COUNTED_AFTER_FIT)
def test_evaluate_and_predict_divide_their_input_too(name, two_ranks, one_process):
    # Their results equal one device's: test_two_*_train_as_one_*.
    workers.assert_divided_after_fit(
        two_ranks[name], one_process[name], CASES[name]["kind"]
    )


def test_a_batch_drawn_before_the_epoch_ends_keeps_its_global_size():
    # Keras 3.16 runs `steps_per_execution` batches per step function: it
    # draws the epoch's last batches, and the input's end, before the steps
    # take them. Each must still be known as its global batch's share, or
    # the step would count this rank's rows as the global batch's.
    import torch

    from keras_parallel.backends.torch.divided_input import DividedInput

    def pairs(*pairs):
        yield from pairs

    divided = DividedInput(world_size=2, rank=0)
    batches = [torch.zeros((32, 3)), torch.zeros((22, 3))]  # Of 64 and 43.
    drawn = list(divided.remembered_pairs(pairs((64, batches[0]), (43, batches[1]))))
    assert [divided.global_rows(b) for b in drawn] == [64, 43]
    # A batch no step took is forgotten when the next epoch starts.
    skipped = torch.zeros((32, 3))
    list(divided.remembered_pairs(pairs((64, skipped))))
    next_epoch = divided.remembered_pairs(pairs((64, torch.zeros((32, 3)))))
    next(next_epoch)
    assert divided.global_rows(skipped) is None
