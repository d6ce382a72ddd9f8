"""Persistence on torch: each rank's own dropout seeds and torch's generator,
and the DTensor variables of ModelParallel gathered whole."""

import contextlib

import torch
from keras import ops

from keras_parallel.backends.checkpoint_io import CheckpointIO
from keras_parallel.backends.torch import dtensor_layouts

_SEED_STRIDE = 1_000_003  # Rank r's dropout seeds start r strides apart.


class TorchCheckpointIO(CheckpointIO):
    """`CheckpointIO` for torch ranks (`TorchExecutor`)."""

    def host_value(self, value):
        if self.executor.holds_dtensors:
            # A collective where the variable is split over ranks.
            value = dtensor_layouts.whole_value(value)
        return ops.convert_to_numpy(value)

    def saving(self, model):
        if not self.executor.holds_dtensors:
            return contextlib.nullcontext()
        # Every rank gathers the split variables; Keras then reads them.
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        return dtensor_layouts.gathered(variables)

    def rank_seed_state(self, state):
        state = torch.as_tensor(state)
        dtype = state.dtype
        state = state.to(torch.int64).clone()
        state[0] = (state[0] + self.executor.process_index * _SEED_STRIDE) % 2**32
        return state.to(dtype)

    def host_random_state(self):
        state = super().host_random_state()
        # Keras's torch data loaders shuffle with torch's global generator.
        state["torch"] = bytes(torch.get_rng_state().numpy())
        return state

    def set_host_random_state(self, state):
        super().set_host_random_state(state)
        torch.set_rng_state(
            torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8)
        )
