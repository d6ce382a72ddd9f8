"""keras_parallel reads no more device values on the host per step than
Keras does, with and without a callback reading every batch's logs (a
progress bar): on torch, in `fit` on 2 ranks against plain Keras in one
process; on JAX (8 devices), against Keras's own `DataParallel`
(`host_reads`). On an accelerator each such read makes the host wait for
the device; a checksum of the batch read with `float()` every step was one.
"""

import host_reads
import keras
import pytest

torch_only = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch ranks"
)

CASES = [
    (source, read_logs)
    for source in ("arrays", "iterable")
    for read_logs in (False, True)
]


def all_cases(distributed):
    return [
        host_reads.reads_per_step(distributed, logs, source) for source, logs in CASES
    ]


@pytest.fixture(scope="module")
def two_ranks():
    from torch_launch import launch

    return launch(all_cases, 2, args=(True,), timeout=240, collective_timeout=60)


@pytest.mark.parametrize(
    "case",
    range(len(CASES)),
    ids=[f"{s}-{'logs' if logs else 'quiet'}" for s, logs in CASES],
)
@torch_only
def test_a_step_reads_no_more_than_one_device(two_ranks, case):
    source, read_logs = CASES[case]
    alone = host_reads.reads_per_step(False, read_logs, source)
    # The counts are real: plain Keras reads the logs a callback reads.
    if read_logs:
        assert sum(alone.values()) >= 2, alone
    for rank in two_ranks:
        reads = rank[case]
        extra = {k: v for k, v in reads.items() if v > alone.get(k, 0)}
        assert extra == {}, (reads, alone)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX devices")
@pytest.mark.parametrize("read_logs", [False, True], ids=["quiet", "logs"])
def test_a_jax_step_copies_no_more_than_keras_data_parallel(read_logs):
    keras_own = host_reads.jax_transfers_per_step("keras", read_logs)
    ours = host_reads.jax_transfers_per_step("keras_parallel", read_logs)
    # Keras converts each step's 2 logs (loss, mae) for its callbacks.
    assert keras_own == 2, keras_own
    assert ours <= keras_own, (ours, keras_own)
