"""What one train step takes of a device under a plan, on torch, before it runs.

torch compiles nothing ahead that could be asked, so Keras's own train step is
measured once, in this process, on two small batches cut from the first batch
(`measure_step`): the bytes its new tensors take above the model's state at
the peak of the forward and backward pass, which grows with the rows, and in
the optimizer's update. Every variable is put back as it was afterwards, so
the measured step trains nothing. Each candidate's prediction is then made
from its plan (`predict`):

    peak = state on the device (the plan's exact bytes)
           + max(forward and backward for the device's rows, as measured,
                 the gradients split as the variables are + the update,
                 its temporaries split as the optimizer state is)
           + DDP's gradient buckets (plain data parallelism: a copy of the
             trainable variables)

and the bytes moved per step from the plan's trainable bytes, as a ring sends
them (`moved`). The allocations are counted by a dispatch mode that sees every
tensor an operation makes and when its storage is freed (`LiveBytes`), on any
device.
"""

import collections
import weakref

import numpy as np
import torch
from keras import ops
from keras.distribution import DataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from keras_parallel.backends.base import StepMemory
from keras_parallel.backends.torch.keras_compat import tree
from keras_parallel.backends.torch.model_parallel import runs_on_mesh

#: Rows of the two measured batches (fewer if the first batch has fewer).
MEASURED_ROWS = (2, 4)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages operations make, while they live.

    A storage is counted when an operation first returns a tensor on it that
    none of its inputs was on (a view or an in-place result is not new), and
    uncounted when it is freed. `peak` is the most counted at once since
    `mark()`.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted = {}

    def mark(self):
        """Starts a new peak from what lives now; returns the bytes living."""
        self.peak = self.live
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            _storage_key(t)
            for t in tree.flatten((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree.flatten(out):
            if isinstance(t, torch.Tensor):
                self._count(t, inputs)
        return out

    def _count(self, tensor, inputs):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # A tensor without storage of its own (a wrapper).
        key = id(storage)
        if key in self._counted or key in inputs:
            return
        size = storage.nbytes()
        self._counted[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key):
        self.live -= self._counted.pop(key, 0)


def _storage_key(tensor):
    try:
        return id(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


#: What `measure_step` found: `fixed` and `per_row` bytes of the forward and
#: backward pass's peak above the state; `gradients`, the bytes living when
#: the update starts; `update`, its peak above them.
Measured = collections.namedtuple("Measured", "fixed per_row gradients update")


def measure_step(model, batch):
    """Measures Keras's train step of `model` on two small batches of `batch`.

    Every variable of the model, its optimizer and metrics is put back as it
    was, and the gradients dropped: nothing is trained.

    Args:
        model: the built model, its optimizer and metrics built.
        batch: `(x, y, sample_weight)`, arrays or tensors.

    Returns:
        A `Measured`.
    """
    rows = _rows(batch)
    sizes = sorted({max(1, min(r, rows)) for r in MEASURED_ROWS})
    state = _state_variables(model)
    saved = [v.value.detach().to("cpu", copy=True) for v in state]
    try:
        peaks = [_measured_once(model, _cut(batch, r)) for r in sizes]
    finally:
        with torch.no_grad():
            for variable, value in zip(state, saved, strict=True):
                variable.value.copy_(value.to(variable.value.device))
        for variable in model.trainable_variables:
            variable.value.grad = None
    (rows_a, (forward_a, gradients, update)) = sizes[0], peaks[0]
    per_row = 0
    if len(sizes) > 1:
        per_row = max(0, (peaks[-1][0] - forward_a) // (sizes[-1] - rows_a))
    return Measured(max(0, forward_a - per_row * rows_a), per_row, gradients, update)


def _measured_once(model, data):
    optimizer = model.optimizer
    live = LiveBytes()
    phases = {}
    own_apply = optimizer.apply

    def apply(*args, **kwargs):
        phases["forward"] = live.peak
        phases["gradients"] = live.mark()
        result = own_apply(*args, **kwargs)
        phases["update"] = live.peak - phases["gradients"]
        return result

    optimizer.apply = apply
    # Keras's step leaves some temporaries in reference cycles, which the
    # collector frees when it happens to run, in the measured step as in
    # training: a step's real peak varies with it (`bench_auto_torch.py`),
    # and so may the processes' measures, of which process 0's is every
    # process's choice (`auto_choice.choose_agreed`). With the collector
    # off the step would count every such temporary: several times the
    # real peak for the Llama of the tests.
    try:
        with live:
            model.train_step(data)
    finally:
        del optimizer.apply  # The instance attribute: the class's again.
    if "forward" not in phases:  # No trainable variable: no update ran.
        return live.peak, 0, 0
    return phases["forward"], phases["gradients"], phases["update"]


def _state_variables(model):
    variables = list(model.variables)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    variables += list(model.metrics_variables)
    return list({id(v): v for v in variables}.values())


def _rows(batch):
    """The rows of the batch's smallest leaf that has rows."""
    return min(int(leaf.shape[0]) for leaf in _leaves_with_rows(batch))


def _leaves_with_rows(batch):
    return [
        leaf
        for leaf in tree.flatten(batch)
        if leaf is not None and len(getattr(leaf, "shape", ()))
    ]


#: `{model: (batch signature, Measured)}`: one measurement per model and
#: batch, which every candidate shares.
_measured = weakref.WeakKeyDictionary()


def candidate_step(model, distribution, plan, batch):
    """`Executor.step_memory` on torch: the step measured once per model and
    batch (`measure_step`), predicted for the candidate (`predict`)."""
    signature = tuple(
        (tuple(int(d) for d in leaf.shape), str(leaf.dtype))
        for leaf in _leaves_with_rows(batch)
    )
    kept = _measured.get(model)
    if kept is None or kept[0] != signature:
        kept = (signature, measure_step(model, batch))
        _measured[model] = kept
    rows = max(shape[0] for shape, _ in signature)
    return predict(kept[1], model, plan, distribution, rows)


def _cut(batch, rows):
    def cut(leaf):
        if leaf is None:
            return None
        if hasattr(leaf, "numpy") or isinstance(leaf, np.ndarray):
            return ops.convert_to_tensor(leaf[:rows])
        # A spec (`shape`, `dtype`) only: zeros of its dtype.
        shape = (rows, *tuple(int(d) for d in leaf.shape[1:]))
        return ops.zeros(shape, dtype=leaf.dtype)

    return tuple(tree.map_structure(cut, tuple(batch)))


def predict(measured, model, plan, distribution, global_rows):
    """The `StepMemory` of one candidate on one device.

    Args:
        measured: `measure_step`'s `Measured`.
        model: the model (which variables are trainable).
        plan: the candidate's `ShardingPlan`.
        distribution: the candidate.
        global_rows: the rows of the global batch.
    """
    num_devices = len(plan.devices)
    data_ways = _data_ways(plan)
    rows = -(-global_rows // data_ways)
    state = plan.bytes_per_device(("model", "optimizer", "metric"))
    trainable = _trainable_bytes(model, plan)
    whole, own = sum(t[0] for t in trainable), sum(t[1] for t in trainable)
    optimizer_whole = plan.bytes_total(("optimizer",))
    optimizer_share = (
        plan.bytes_per_device(("optimizer",)) / optimizer_whole
        if optimizer_whole
        else 1.0
    )
    on_mesh = runs_on_mesh(distribution)
    # The forward and backward pass, as measured on one device for the
    # device's rows: not divided by a model axis, nor its gradients by a
    # split (computed whole, then reduced to the shard), which keeps it an
    # upper bound. A variable split by `shard="full"` is gathered where it
    # is used and freed after: the measured peaks (`bench_auto_torch.py`)
    # show no whole copy kept.
    forward = measured.fixed + measured.per_row * rows
    gradient_share = own / whole if whole else 1.0
    # The update: the gradients split as the variables are, its temporaries
    # as the optimizer state is.
    update = int(
        measured.gradients * gradient_share + measured.update * optimizer_share
    )
    peak = state + max(forward, update)
    if not on_mesh and isinstance(distribution, DataParallel) and num_devices > 1:
        peak += whole  # DDP's buckets: a copy of every gradient.
    return StepMemory(int(peak), moved(plan, whole, own))


def moved(plan, whole, own):
    """The bytes one device sends per step for the gradients, from the plan.

    As a ring sends them, over the `d` devices that hold the same variables'
    part (`d` = the data axis): plain data parallelism all-reduces every
    gradient (`2 G (d-1)/d`); `shard="optimizer"` reduce-scatters them and
    gathers the updated variables (the same bytes); `shard="full"` gathers
    the variables in the forward and the backward pass and reduce-scatters
    the gradients (`3 G (d-1)/d`). `G` is the trainable bytes one data
    replica holds (`own` times the model axis). The model axis's own
    collectives (layer outputs) are not counted.
    """
    num_devices = len(plan.devices)
    data_ways = _data_ways(plan)
    if data_ways <= 1:
        return 0
    share = (data_ways - 1) / data_ways
    if plan.shard == "full":
        replica = whole * num_devices // data_ways if own < whole else whole
        return int(3 * min(whole, replica) * share)
    model_ways = num_devices // data_ways
    replica = min(whole, own * model_ways) if model_ways > 1 else whole
    return int(2 * replica * share)


def _data_ways(plan):
    if plan.batch_axis in plan.axis_names:
        return int(plan.mesh_shape[plan.axis_names.index(plan.batch_axis)])
    return len(plan.devices)


def _trainable_bytes(model, plan):
    """`[(whole bytes, bytes on one device)]` of the trainable variables."""
    trainable = {v.path for v in model.trainable_variables}
    return [
        (v.bytes_total, v.bytes_per_device)
        for v in plan.variables
        if v.kind == "model" and v.path in trainable
    ]
