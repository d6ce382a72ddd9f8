"""The first call of every model form is distributed, through both doors.

A model that is not built when the distribution is given (a subclassed
model, a Sequential without an `Input`, a model nesting an unbuilt one) is
planned inside its first entry point, once Keras built it. The rest of that
entry point must run under the plan: the batch split over the devices, not
computed whole by each. The `BatchProbe` first in each model records what
one device computed (`split_probe`); weights alone could not tell.
"""

import keras
import model_forms
import pytest
import split_probe

BACKEND = keras.backend.backend()

in_process = pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"),
    reason="one process, several devices: JAX and TensorFlow",
)


def _data_parallel():
    import keras_parallel

    if BACKEND == "tensorflow":
        import tf_devices

        return keras_parallel.DataParallel(devices=tf_devices.devices(4)), 4
    return keras_parallel.DataParallel(), 8


@in_process
@pytest.mark.parametrize("form,door,entry_point", model_forms.cases())
def test_first_call_splits_the_batch(form, door, entry_point):
    distribution, ways = _data_parallel()
    recorded = model_forms.first_call(form, door, entry_point, distribution)
    split_probe.assert_divided(recorded, model_forms.BATCH, ways)


@pytest.mark.skipif(BACKEND != "jax", reason="ModelParallel in one process: JAX")
@pytest.mark.parametrize("form", model_forms.FORMS)
def test_first_fit_under_model_parallel_splits_the_batch(form):
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*d2/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    recorded = model_forms.first_call(form, "mixin", "fit", distribution)
    split_probe.assert_divided(recorded, model_forms.BATCH, 4)


def test_the_probe_sees_a_step_computed_whole():
    # The proof can fail: one device computing the global batch is refused.
    with pytest.raises(AssertionError, match="not split"):
        split_probe.assert_divided([(16, 16)], 16, 8)
    with pytest.raises(AssertionError, match="not split"):
        split_probe.assert_divided([(None, 16)], 16, 2)
    with pytest.raises(AssertionError, match="more than"):
        split_probe.assert_divided([(32, 4)], 16, 8)
    with pytest.raises(AssertionError, match="saw no step"):
        split_probe.assert_divided([], 16, 8)


torch_only = pytest.mark.skipif(
    BACKEND != "torch", reason="torch: one process per rank"
)


def _launch_first_calls(num_processes, selected, model_parallel=False):
    from torch_launch import launch

    return launch(
        model_forms.first_call_run,
        num_processes,
        args=(selected, model_parallel),
        timeout=300,
        collective_timeout=60,
    )


@torch_only
def test_first_call_splits_the_batch_over_torch_ranks():
    selected = model_forms.cases()
    per_rank = _launch_first_calls(2, selected)
    _assert_every_rank_divided(selected, per_rank, ways=2)


@torch_only
def test_first_fit_under_torch_model_parallel_splits_the_batch():
    selected = [(form, "mixin", "fit") for form in model_forms.FORMS]
    selected += [(form, "callback", "fit") for form in model_forms.FORMS]
    per_rank = _launch_first_calls(4, selected, model_parallel=True)
    _assert_every_rank_divided(selected, per_rank, ways=2)  # A (2, 2) mesh.


def _assert_every_rank_divided(selected, per_rank, ways):
    for i, case in enumerate(selected):
        for rank, recorded in enumerate(per_rank):
            try:
                split_probe.assert_divided(recorded[i], model_forms.BATCH, ways)
            except AssertionError as error:
                raise AssertionError(f"{case} on rank {rank}: {error}") from None
