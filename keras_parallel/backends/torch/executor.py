"""The torch executor: DistributedDataParallel under Keras's own torch trainer.

One process per device, each running the unchanged script under Keras's
torch trainer (docs/torch.md). `apply` gives every rank rank 0's weights and
`scope` installs the per-rank steps (`steps.RankSteps`); a distribution that
splits variables runs on DTensors (`model_parallel.MeshRunner`). In one
process without a group, `fit` is plain Keras.
"""

import contextlib
import functools

import numpy as np
import torch
import torch.distributed as dist
from keras.distribution import DataParallel, ModelParallel

from keras_parallel.backends.base import AutoSupport, Executor
from keras_parallel.backends.torch import distribution_lib
from keras_parallel.backends.torch import group as torch_group
from keras_parallel.backends.torch.checkpoint_io import TorchCheckpointIO
from keras_parallel.backends.torch.creation import placed_creation
from keras_parallel.backends.torch.ddp_module import DDPModule, keras_ddp_off
from keras_parallel.backends.torch.flat_buffers import (
    broadcast_bytes,
    broadcast_flat,
    on_group_device,
)
from keras_parallel.backends.torch.model_parallel import MeshRunner, runs_on_mesh
from keras_parallel.backends.torch.step_logs import StepLogPolicy
from keras_parallel.backends.torch.steps import RankSteps
from keras_parallel.backends.torch.sync_bn import SyncBatchNorm
from keras_parallel.errors import ShardingError
from keras_parallel.keras_seam.model_state import state_of
from keras_parallel.messages import signed_store
from keras_parallel.run.chief import (
    ChiefOnlyCallbacks,
    ChiefWritesInFit,
    process_saving,
)

# Done when Keras is imported (`keras_parallel/__init__.py`), unless this
# backend's own import is what imported Keras: then here.
distribution_lib.provide()


class TorchExecutor(Executor):
    """Runs `DataParallel` with DDP and `ModelParallel` with DTensors.

    Options are read from the distribution, where the user gives it:
    `sync_batchnorm` (default False) and `find_unused_parameters` (default
    False, as DDP's).
    """

    backend = "torch"
    checkpoint_io_class = TorchCheckpointIO

    def __init__(self, distribution):
        super().__init__(distribution)
        torch_group.ensure_process_group()
        self._ddp = None
        self._steps = None
        self._model = None
        #: Set by `check` for a ModelParallel that splits variables.
        self._mesh_runner = None

    # ----------------------------------------------------------- devices
    @classmethod
    def list_devices(cls):
        """One device per process of the group: `["cpu:0", "cpu:1"]`.

        In one process without a group: `["cpu:0"]` (or `["cuda:0"]`).
        """
        torch_group.ensure_process_group()
        world = dist.get_world_size() if dist.is_initialized() else 1
        return [f"{torch_group.device_type()}:{i}" for i in range(world)]

    def device_names(self, devices):
        # `keras.distribution.list_devices()` names a CUDA device "gpu:i"
        # (Keras 3.16, and `distribution_lib` on 3.15), torch "cuda:i".
        return [str(d).lower().replace("gpu", "cuda") for d in devices]

    @classmethod
    def more_devices_hint(cls):
        # One process per device: a lone process is one device, GPUs or not.
        return (
            "start one process per device: `keras-parallel launch --nproc 2 "
            "script.py` or `torchrun --nproc-per-node 2 script.py`"
        )

    # -------------------------------------------------------------- Auto
    auto_support = AutoSupport(candidate_kinds=("shard", "model"))

    @classmethod
    def device_memory(cls):
        # A GPU reports its size; a CPU nothing.
        if torch_group.device_type() != "cuda":
            return None
        return int(torch.cuda.mem_get_info()[1])

    @classmethod
    def step_memory(cls, model, distribution, plan, batch):
        from keras_parallel.backends.torch import step_memory

        return step_memory.candidate_step(model, distribution, plan, batch)

    @classmethod
    def creation_scope(cls, distribution):
        """Places each variable made in `distribution.scope()` at once.

        For a distribution that runs on DTensors (`shard=`, or a mesh that
        splits a variable): every floating variable its layout splits is
        placed as soon as it is made, rank 0's value scattered, so that no
        process holds more than its shards and the variable being made
        (`creation.placed_creation`). Otherwise (DDP): nothing.

        Args:
            distribution: the distribution whose scope is entered.

        Returns:
            A context manager.
        """
        if not runs_on_mesh(distribution):
            return contextlib.nullcontext()
        return placed_creation(distribution)

    # --------------------------------------------------------- lifecycle
    def check(self, distribution):
        layout_map = getattr(distribution, "_layout_map", None)
        data_parallel = layout_map is None and isinstance(distribution, DataParallel)
        if not data_parallel and not isinstance(distribution, ModelParallel):
            raise ShardingError(
                "The torch backend runs DataParallel and ModelParallel. "
                f"Received: {type(distribution).__name__}; use "
                "keras_parallel.DataParallel() or keras.distribution."
                "ModelParallel(layout_map=..., batch_dim_name=...)."
            )
        # A mesh that splits nothing but the batch is data parallelism: DDP.
        # `shard=` splits variables or optimizer state over the batch axis:
        # DTensors, on any mesh (`model_parallel.runs_on_mesh`).
        self._mesh_runner = None
        if runs_on_mesh(distribution):
            self._mesh_runner = MeshRunner(self)
        mesh_size = int(np.prod(distribution.device_mesh.shape))
        if mesh_size == self.num_processes:
            return
        if data_parallel:
            raise ShardingError(
                "On torch, DataParallel needs one device per process of the "
                f"process group. Received: a mesh of {mesh_size} devices and "
                f"{self.num_processes} process(es); use "
                "keras_parallel.DataParallel() with no argument, and start "
                f"{mesh_size} processes with `torchrun --nproc-per-node "
                f"{mesh_size}` or `keras-parallel launch --nproc {mesh_size}`."
            )
        what = "more" if self.num_processes > mesh_size else "fewer"
        raise ShardingError(
            f"On torch, {type(distribution).__name__} needs one process per "
            f"device of its mesh, but {what} processes run. Received: a mesh "
            f"of shape {tuple(distribution.device_mesh.shape)} "
            f"({mesh_size} devices) and {self.num_processes} process(es); "
            f"start {mesh_size} processes (`torchrun --nproc-per-node "
            f"{mesh_size}`, `keras-parallel launch --nproc {mesh_size}`), or "
            f"give the mesh a shape that multiplies to {self.num_processes}."
        )

    def apply(self, model, plan):
        if self._mesh_runner is not None:
            self._model = model
            self._mesh_runner.apply(model, plan)
            self._steps = self._mesh_runner.steps
            keras_ddp_off(model)
            return
        if model is not self._model:
            self.close()
        self._model = model
        if not torch_group.is_distributed():
            # Plain Keras on one device; the binding says so
            # (`report.one_device_hint`).
            return
        self._fold_rank_into_seeds(model)
        self._ddp = None  # Drop the old wrapper before making the new.
        make_ddp = None
        keras_ddp_off(model)
        if getattr(self.distribution, "find_unused_parameters", False) and any(
            p.requires_grad for p in DDPModule(model, model.call).parameters()
        ):
            self._make_ddp(model)
        else:
            # Every rank starts from rank 0's weights, as DDP's would; DDP
            # comes after the first step, once every trainable variable had
            # a gradient (`gradient_mean`).
            broadcast_flat(DDPModule(model, model.call).parameters())
            make_ddp = functools.partial(self._make_ddp, model)
        if self._steps is None:
            self._steps = RankSteps(
                model, self._ddp, self.num_processes, self.process_index, make_ddp
            )
        else:
            # Planned again (fit built the optimizer) while an entry point
            # runs: the installed steps stay, with the new wrapper.
            self._steps.use_ddp(self._ddp, make_ddp)
        torch_group.on_teardown(self)

    def saving_override(self, model):
        if self._mesh_runner is not None:
            return self._mesh_runner.saving_override(model)
        if not torch_group.is_distributed():
            return None
        return process_saving(model, self)

    def _make_ddp(self, model):
        steps = self._steps
        # Made after the first step, while the entry point's `call` is in
        # place: DDP runs the model's own.
        own = steps.own_call() if steps is not None and steps.model is model else None
        module = DDPModule(model, own or model.call)
        device_ids = None
        if torch_group.device_type() == "cuda":
            device_ids = [torch.cuda.current_device()]
        self._ddp = torch.nn.parallel.DistributedDataParallel(
            module,
            device_ids=device_ids,
            find_unused_parameters=bool(
                getattr(self.distribution, "find_unused_parameters", False)
            ),
        )
        return self._ddp

    def _fold_rank_into_seeds(self, model):
        # Every rank built the same seed states; offset them once so each
        # rank draws its own dropout masks, as slices of one global batch do.
        state = state_of(model)
        if state.seeds_folded:
            return
        state.seeds_folded = True
        for variable in model.non_trainable_variables:
            if "seed_generator_state" in variable.path:
                state = self.checkpoint_io.rank_seed_state(variable.value.detach())
                with torch.no_grad():
                    variable.value.copy_(torch.as_tensor(state))

    @contextlib.contextmanager
    def scope(self, model):
        # Keras 3.16 wraps the model in its DDP as it makes a step function,
        # before an unbuilt model is planned (its first `predict`): off from
        # the start, and put back if no plan took the model.
        distributed = torch_group.is_distributed()
        if distributed:
            keras_ddp_off(model)
        try:
            yield
        except BaseException as error:
            # The other ranks learn which rank failed, and why, without a
            # collective (they may never reach one).
            torch_group.publish_failure(self.process_index, error)
            raise
        finally:
            if distributed and model is not self._model:
                keras_ddp_off(model, off=False)

    @contextlib.contextmanager
    def planned_scope(self, model):
        if self._steps is None or model is not self._model:
            yield
            return
        installed = []
        try:
            self.share_host_random_state()
            for part in self._scope_parts(model):
                part.install()
                installed.append(part)
            yield
            if self._steps.dirty:
                self._steps.sync_non_trainable()
        finally:
            for part in reversed(installed):
                part.uninstall()

    def _scope_parts(self, model):
        on_mesh = self._mesh_runner is not None
        parts = [self._steps, StepLogPolicy(self._steps)]
        # A ModelParallel mesh of batch and size-1 axes runs on DDP with the
        # global batch statistics JAX's ModelParallel uses.
        if not on_mesh and (
            getattr(self.distribution, "sync_batchnorm", False)
            or not isinstance(self.distribution, DataParallel)
        ):
            parts.append(SyncBatchNorm(model))
        # A group of one process (a single GPU's run) has no other process
        # to tell of its writes.
        writes = self.chief_writes()
        if writes is not None:
            parts.append(ChiefWritesInFit(writes, model=model))
        if not self.is_chief:
            # On a mesh, saving gathers the split variables: a collective.
            parts.append(ChiefOnlyCallbacks(collective_saving=on_mesh, model=model))
        return parts

    def release(self, model):
        if self._mesh_runner is not None:
            self._mesh_runner.release(model)
            self._steps = None
        else:
            self.close()
        keras_ddp_off(model, off=False)
        self._model = None

    def close(self):
        """Drops the DDP wrapper before the process group goes (at exit)."""
        if self._steps is not None:
            self._steps.uninstall()
        self._steps = None
        self._ddp = None

    @classmethod
    def first_step_batch(cls, kind, args):
        # Keras's torch step functions take a list of one batch.
        data = args[0] if args else None
        if isinstance(data, (list, tuple)) and data:
            return data[0], args
        return None, args

    def step_inputs(self, kind, args):
        # Keras's torch `predict` and `predict_on_batch` build an unbuilt
        # model in their first step, called with a list of batches `[(x,)]`.
        data = args[0] if args else None
        if kind == "predict" and isinstance(data, (list, tuple)) and data:
            batch = data[0]
            return batch[0] if isinstance(batch, (list, tuple)) else batch
        return None

    @property
    def holds_dtensors(self):
        """Whether the model's variables are DTensors over a mesh (ModelParallel)."""
        return self._mesh_runner is not None

    # ------------------------------------------------------- collectives
    @property
    def num_processes(self):
        return dist.get_world_size() if torch_group.is_distributed() else 1

    @property
    def process_index(self):
        return dist.get_rank() if torch_group.is_distributed() else 0

    def reduce(self, value, op="mean"):
        if not torch_group.is_distributed():
            return value
        if op not in ("mean", "sum"):
            raise ValueError(
                f"reduce supports op='mean' or 'sum'. Received: op={op!r}."
            )
        # On the group's device: NCCL takes CUDA tensors only.
        tensor = on_group_device(torch.as_tensor(value, dtype=torch.float64).clone())
        dist.all_reduce(tensor)
        if op == "mean":
            tensor /= self.num_processes
        if isinstance(value, torch.Tensor):
            return tensor.to(device=value.device, dtype=value.dtype)
        tensor = tensor.cpu()
        if np.ndim(value) == 0:
            return float(tensor)
        return tensor.numpy()

    def broadcast_bytes(self, payload, src=0):
        if not torch_group.is_distributed():
            return payload
        return broadcast_bytes(payload, src)

    def key_value_store(self):
        if not torch_group.is_distributed():
            return super().key_value_store()
        return signed_store.for_run(torch_group.KeyValueStore(), self.process_index)

    def barrier(self):
        if torch_group.is_distributed():
            dist.barrier()
