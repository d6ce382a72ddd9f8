"""A model's metric states, made global over the ranks by their change.

Each state becomes its value when last made global plus the sum over the ranks
of its change since. The same all-reduce carries the batches' check
(`batches.check_same_batches`, read on the host only at `verify`) and a custom
step's logs.
"""

import torch
import torch.distributed as dist

from keras_parallel.backends.torch.batches import (
    batch_spreads,
    check_same_batches,
    checksum,
)
from keras_parallel.backends.torch.flat_buffers import unpack_flat


class MetricStates:
    """The metric states of one model, made global when asked.

    >>> states.start()
    >>> model.train_step(batch)          # updates this rank's states
    >>> states.saw(rows, batch)
    >>> states.reduce(counted=True)      # one all-reduce: global states
    """

    def __init__(self, model, rank):
        self.model = model
        self.rank = rank
        self._pending = None  # The states when last made global, flat.
        self._rows_seen = 0.0  # Rows and checksums since then.
        self._check_seen = 0.0
        # Since the last `verify`, not yet read on the host.
        self._spreads = None
        self._rows_unverified = 0.0
        self._total_unverified = None

    @property
    def pending(self):
        """Whether this rank's states may hold changes not made global."""
        return self._pending is not None

    def start(self):
        """Remembers the states as they are now, unless already remembered."""
        if self._pending is None:
            self._pending = self.snapshot()

    def saw(self, rows, data):
        """Adds a global batch to the rows and checksum the ranks compare."""
        self._rows_seen += rows
        self._check_seen += checksum(data)

    def snapshot(self):
        """The states as one flat float64 tensor."""
        variables = list(self.model.metrics_variables)
        if not variables:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(
            [v.value.detach().reshape(-1).to(torch.float64) for v in variables]
        )

    def restore(self, flat):
        """Sets the states from a `snapshot()`."""
        unpack_flat(flat, [v.value for v in self.model.metrics_variables])

    def reduce(self, counted, extra=None, verify=True):
        """Makes the states global; sums `extra` over the ranks with them.

        Args:
            counted: whether this rank's changes count (False where another
                rank counts a batch every rank computed whole).
            extra: an optional float64 tensor for the same all-reduce.
            verify: whether to compare the ranks' batches now (a host read).

        Returns:
            `extra` summed over the ranks (empty without `extra`).
        """
        before, self._pending = self._pending, None
        after = self.snapshot()
        delta = after - before.to(after.device)
        if not counted:
            delta = torch.zeros_like(delta)
        rows, check = self._rows_seen, self._check_seen
        self._rows_seen = self._check_seen = 0.0
        check = torch.as_tensor(check, dtype=torch.float64).to(delta.device)
        rows_t = torch.tensor(rows, dtype=torch.float64, device=delta.device)
        checks = torch.stack([torch.ones_like(rows_t), rows_t, rows_t * rows_t])
        checks = torch.cat([checks, torch.stack([check, check * check])])
        if extra is None:
            extra = torch.zeros(0, dtype=torch.float64)
        n = delta.numel()
        packed = torch.cat([delta, checks, extra.to(delta.device)])
        dist.all_reduce(packed)
        self.restore(before.to(after.device) + packed[:n])
        sums = packed[n : n + len(checks)]
        spreads = batch_spreads(sums)
        if self._spreads is not None:
            spreads = torch.maximum(spreads, self._spreads)
            sums = sums + self._total_unverified
        self._spreads, self._total_unverified = spreads, sums
        self._rows_unverified += rows
        if verify:
            self.verify()
        if not len(extra):
            return extra
        return packed[n + len(checks) :].cpu()

    def verify(self):
        """Compares the ranks' batches since the last comparison (a host read)."""
        if self._spreads is None:
            return
        spreads, sums = self._spreads, self._total_unverified
        rows = self._rows_unverified
        self._spreads = self._total_unverified = None
        self._rows_unverified = 0.0
        host = torch.cat([spreads, sums]).cpu().tolist()
        ranks, total = host[2], host[3]
        check_same_batches(host[:2], self.rank, rows, total / max(ranks, 1.0))
