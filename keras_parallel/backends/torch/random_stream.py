"""Each rank's own random stream for what a train step draws.

Every rank starts from rank 0's random state so that all shuffle alike, which
would give unseeded dropout the same masks everywhere; a train step runs on a
state of the rank's own, and the shared state is put back.
"""

import torch

#: Rank r's stream starts from a seed r strides from rank 0's.
SEED_STRIDE = 1_000_003


def _states():
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return cpu, cuda


def _set_states(states):
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class RankRandomStream:
    """A rank's own torch random state, entered around a train step.

    >>> with RankRandomStream(rank=1):
    ...     outputs = model(x, training=True)  # rank 1's dropout masks
    """

    def __init__(self, rank):
        self.rank = rank
        self._own = None
        self._shared = None

    def __enter__(self):
        self._shared = _states()
        if self._own is None:
            # From the shared stream, unconsumed: masks follow the user's seed.
            base = int(torch.randint(0, 2**62, (1,)))
            _set_states(self._shared)
            torch.manual_seed(base + self.rank * SEED_STRIDE)
        else:
            _set_states(self._own)
        return self

    def __exit__(self, *exc_info):
        self._own = _states()
        _set_states(self._shared)
        self._shared = None
        return False
