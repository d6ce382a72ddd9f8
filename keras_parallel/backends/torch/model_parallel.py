"""`ModelParallel` on torch: the executor's hooks for a mesh of DTensors.

A distribution that splits variables or asks for `shard=` runs through a
`MeshRunner` (`runs_on_mesh`); one that splits only the batch keeps DDP,
which is faster. `apply` places the variables as DTensors and, for the
model's distributed life, gathers them to be read or saved; `scope_parts`
installs the `MeshSteps`; `release` makes every variable plain again.
"""

from keras_parallel.backends.torch import dtensor_layouts
from keras_parallel.backends.torch import group as torch_group
from keras_parallel.backends.torch.mesh_steps import MeshSteps
from keras_parallel.backends.torch.step_logs import StepLogPolicy
from keras_parallel.keras_seam.overrides import Overrides, override
from keras_parallel.keras_seam.replacements import Replacements
from keras_parallel.plan.layout_keys import reference_of
from keras_parallel.plan.sharding_plan import iter_planned_variables
from keras_parallel.run.chief import (
    ChiefOnlyCallbacks,
    ChiefWritesInFit,
    chief_only_saving,
    chief_saving,
)


def runs_on_mesh(distribution):
    """Whether a distribution runs on DTensor variables (`MeshRunner`).

    Args:
        distribution: a `keras.distribution.Distribution`.

    Returns:
        True if its mesh splits a variable (`splits_model`) or it asks to
        shard variables or optimizer state over a batch axis of more than
        one device (`shard=`, `keras_parallel.plan.sharding`), even on a 1-D
        mesh: DDP keeps whole copies of both on every rank. One device
        splits nothing: plain Keras, as without `shard`.
    """
    if getattr(distribution, "shard", None) is not None:
        mesh = distribution.device_mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        if int(sizes.get(distribution.batch_dim_name, 1)) > 1:
            return True
    return getattr(distribution, "_layout_map", None) is not None and splits_model(
        distribution
    )


def splits_model(distribution):
    """Whether a distribution's mesh splits anything but the batch.

    Args:
        distribution: a `keras.distribution.Distribution`.

    Returns:
        True if an axis other than `batch_dim_name` has more than one
        device: `ModelParallel` needs DTensors. A mesh `(4, 1)` does not:
        it is data parallelism, and runs as such (DDP).
    """
    mesh = distribution.device_mesh
    return any(
        int(size) > 1
        for name, size in zip(mesh.axis_names, mesh.shape, strict=True)
        if name != distribution.batch_dim_name
    )


class MeshRunner:
    """Runs a `ShardingPlan` with DTensor variables on a torch mesh.

    Args:
        executor: the `TorchExecutor` (distribution, rank, collectives).
    """

    def __init__(self, executor):
        self.executor = executor
        self.mesh = None
        self.steps = None
        self.model = None
        #: Each placed variable's `numpy` and `assign` (`_make_usable`).
        self._methods = Replacements()

    def _torch_mesh(self):
        if self.mesh is None:
            self.mesh = dtensor_layouts.torch_mesh(
                self.executor.distribution.device_mesh, torch_group.device_type()
            )
        return self.mesh

    def apply(self, model, plan):
        """Places the planned variables as DTensors (a collective)."""
        if model is not self.model:
            self.release_steps()
        self.model = model
        mesh = self._torch_mesh()
        keras_mesh = self.executor.distribution.device_mesh
        gradients = gradient_axes(model, plan)
        with dtensor_layouts.promotion():
            for variable, entry in iter_planned_variables(model, plan):
                if dtensor_layouts.is_placed(entry, variable):
                    dtensor_layouts.place(
                        variable,
                        entry.axes,
                        keras_mesh,
                        mesh,
                        gradient_axes=gradients.get(id(variable)),
                    )
                    self._make_usable(variable)
                else:
                    # One the plan keeps plain (a metric's state) that was
                    # made split inside `distribution.scope()` (`creation`).
                    dtensor_layouts.unplace(variable)
        dtensor_layouts.retrack(model)
        if self.steps is None:
            self.steps = MeshSteps(model, mesh, plan, self.executor.process_index)
        else:
            # Planned again (fit built the optimizer) while an entry point
            # may run: the installed steps take the new plan.
            self.steps.plan = plan
        torch_group.on_teardown(self)

    def saving_override(self, model):
        """`Executor.saving_override`: process 0 gathers the split variables
        and writes; the others write nothing (both take part in the gather).

        For the model's whole distributed life, not only while an entry
        point runs: after `fit` with a `ShardingCallback` (whose own saving
        ends with the run), the variables are still split, and a save is
        still a collective.
        """
        saving = self.executor.checkpoint_io.saving
        writes = self.executor.chief_writes()
        if not self.executor.is_chief:
            return lambda: chief_only_saving(model, saving, writes)
        if writes is None:
            return lambda: gathered_saving(model, saving)

        def gathered_and_told():
            # Told after the write: `ChiefSaving` goes first in the class.
            ends = [gathered_saving(model, saving), chief_saving(model, writes)]
            return lambda: [end() for end in reversed(ends)]

        return gathered_and_told

    def _make_usable(self, variable):
        # Outside an entry point too (after `fit` through either door), a
        # placed variable reads and takes whole values as a plain one does:
        # Keras's `Variable.numpy()` (which `Layer.get_weights()` calls)
        # fails on a DTensor (".numpy() is not supported for tensor
        # subclasses"), and its `assign` (`set_weights`, `load_weights`)
        # copies a plain value into a DTensor, which torch refuses ("got
        # mixed torch.Tensor and DTensor"). Only these methods of this
        # object: `np.asarray(variable)` still raises, so that a callback
        # reading weights on rank 0 alone (a `TensorBoard` histogram) fails
        # at once rather than starting a gather the other ranks never join.
        if "numpy" not in vars(variable):  # Placed by an earlier `apply`.
            self._methods.replace(variable, "numpy", whole_numpy(variable))
            self._methods.replace(
                variable, "assign", replicated_assign(variable.assign)
            )

    def scope_parts(self, model):
        """What `TorchExecutor.scope` installs while an entry point runs."""
        parts = [self.steps, StepLogPolicy(self.steps)]
        writes = self.executor.chief_writes()
        if writes is not None:
            parts.append(ChiefWritesInFit(writes, model=model))
        if not self.executor.is_chief:
            parts.append(ChiefOnlyCallbacks(collective_saving=True, model=model))
        return parts

    def release_steps(self):
        if self.steps is not None:
            self.steps.uninstall()
        self.steps = None

    def release(self, model):
        """Every variable whole and plain again (a collective)."""
        self.release_steps()
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        for variable in variables:
            dtensor_layouts.unplace(variable)
        dtensor_layouts.retrack(model)
        self._methods.restore()
        self.model = None

    def close(self):
        """Drops the steps before the process group goes (at exit)."""
        self.release_steps()


def gradient_axes(model, plan):
    """The layout of each model variable's gradient where it is not its own.

    Under `shard="optimizer"` a variable stays whole but its optimizer slots
    are split over the batch axis. Its gradient then takes the slots'
    layout: the sums over the batch are reduce-scattered, not all-reduced,
    and each rank updates its shard of the slots from its shard of the
    gradient; the update of the whole variable gathers the shards (DTensor
    all-gathers the update of a replicated variable from a sharded one).
    That is ZeRO-2: a whole gradient is never reduced, and each rank keeps
    only its shard of it. Under any other plan a gradient takes its
    variable's layout.

    Args:
        model: the model the plan was made for.
        plan: its `ShardingPlan`.

    Returns:
        `{id(variable): axes}` for the variables whose gradient is laid out
        otherwise than the variable.
    """
    if plan.shard != "optimizer":
        return {}
    planned = list(iter_planned_variables(model, plan))
    axes_of = {id(v): e.axes for v, e in planned}
    references = {v.path.replace("/", "_"): v for v, e in planned if e.kind == "model"}
    gradients = {}
    for variable, entry in planned:
        if entry.kind != "optimizer":
            continue
        reference = reference_of(variable, references)
        if reference is None or not reference.trainable:
            continue
        if entry.axes != axes_of[id(reference)]:
            gradients.setdefault(id(reference), entry.axes)
    return gradients


def whole_numpy(variable):
    """`variable.numpy()` that gathers a DTensor value whole first.

    Reading a split variable is a collective: every rank must read the same
    variables in the same order, as `get_weights()` on every rank does.

    Args:
        variable: a `keras.Variable` that `dtensor_layouts.place` placed.

    Returns:
        A function of no argument returning the whole value as NumPy.
    """

    def numpy():
        from keras import ops

        return ops.convert_to_numpy(dtensor_layouts.whole_value(variable.value))

    return numpy


def replicated_assign(assign):
    """`variable.assign` that takes a plain value as the same on every rank.

    The value is whole (`set_weights`, `load_weights`), the same on every
    process: each keeps its own part of it (`dtensor_layouts.promotion`),
    with no collective.

    Args:
        assign: the variable's own `assign`.

    Returns:
        The function to call instead.
    """

    def assign_replicated(value):
        with dtensor_layouts.promotion():
            return assign(value)

    return assign_replicated


class GatheredSaving(Overrides):
    """`save` and `save_weights` with the split variables gathered first.

    Args:
        saving: the executor's `checkpoint_io.saving`.
    """

    names = ("save", "save_weights")

    def __init__(self, saving):
        self.saving = saving

    def save(self, *args, **kwargs):
        with self.saving(self.model):
            return self.overridden.save(*args, **kwargs)

    def save_weights(self, *args, **kwargs):
        with self.saving(self.model):
            return self.overridden.save_weights(*args, **kwargs)


def gathered_saving(model, saving):
    """Makes `model.save` and `save_weights` gather first, on rank 0.

    The other ranks join the same gathers without writing
    (`chief.chief_only_saving`): Keras then reads plain values.

    Args:
        model: the model of the chief process.
        saving: the executor's `checkpoint_io.saving`.

    Returns:
        A function that undoes it.
    """
    return override(model, GatheredSaving(saving))
