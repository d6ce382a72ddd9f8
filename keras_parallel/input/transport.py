"""The divided input's transport: what one process made, handed to the others.

Every backend divides the input alike. A batch one process made (a
generator's, a `PyDataset`'s) goes to the processes that need its rows, and
a `DataLoader`'s shuffle starts from process 0's torch random state on
every process. Here, once for every backend: the values travel in the wire
format (`keras_parallel.messages.wire`), decoded as numbers and never unpickled,
with the key and the sender named when a payload does not decode; the
end of a source is one marker; the keys are named one way.

What moves the bytes is the executor's: a collective scatter (torch's
ranks step together), or a key-value store (JAX's and TensorFlow's
coordination services), which lets the owner draw on without waiting.

Example:

```python
handout = transport.Handout(process, processes, store=store)
key = transport.batch_key(run, position)
part = handout.give(key, owner=0, parts=parts if process == 0 else None)
if transport.is_end(part):
    return
```
"""

from keras_parallel.messages import wire
from keras_parallel.run import stall_watch
from keras_parallel.run.stall_positions import EVERY_PROCESS

#: What an owner hands out once its source ran out, or was abandoned.
END = "keras_parallel: end of the epoch"
_PREFIX = "keras_parallel/input"


def batch_key(run, position):
    """The name of batch `position` of a source's run `run`, the same on
    every process (a store's keys add the receiving process)."""
    return f"{_PREFIX}/{run}/{position}"


def is_end(value):
    """Whether `value` is the end of the source (`END`)."""
    return isinstance(value, str) and value == END


class Handout:
    """Hands each process its part of a value one process made.

    Args:
        process: this process's index.
        processes: how many processes share the input.
        scatter_bytes: a collective `(payloads or None, owner) -> payload`
            every process calls together (torch's ranks).
        store: a key-value store with `put_bytes(key, payload)` and
            `take_bytes(key)` (the payload once written, deleted once read;
            `None` where the reader gave up: the entry point ended).
        who: what a process is called in messages ("rank", "worker").

    Exactly one of `scatter_bytes` and `store` is given.
    """

    def __init__(
        self, process, processes, *, scatter_bytes=None, store=None, who="process"
    ):
        if (scatter_bytes is None) == (store is None):
            raise ValueError(
                "a Handout moves bytes one way. Received: "
                f"scatter_bytes={scatter_bytes!r}, store={store!r}; pass one."
            )
        self.process = process
        self.processes = processes
        self.scatter_bytes = scatter_bytes
        self.store = store
        self.who = who

    def give(self, key, owner, parts):
        """This process's part of what `owner` made.

        Args:
            key: the value's name (`batch_key`), the same on every process.
            owner: the index of the process that made it.
            parts: on the owner, one value per process, by index (its own
                included); `None` on every other process.

        Returns:
            This process's part; `END` where the owner handed out the end,
            or the store's reader gave up.

        Raises:
            wire.WireFormatError: a payload that is not keras_parallel's
                data, naming the key and the sender.
        """
        where = f"{key!r} from {self.who} {owner}"
        if self.scatter_bytes is not None:
            payloads = None if parts is None else [wire.encode(p) for p in parts]
            # A collective: the owner waits for every process (one asleep
            # making its own part is the stall), the others for the owner.
            waits_for = owner if parts is None else EVERY_PROCESS
            with stall_watch.waiting_for(waits_for):
                payload = self.scatter_bytes(payloads, owner)
            return wire.decode(payload, where=where)
        if self.process == owner:
            encoded = {}  # A value handed to several processes, encoded once.
            for process, part in enumerate(parts):
                if process != owner:
                    if id(part) not in encoded:
                        encoded[id(part)] = wire.encode(part)
                    self.store.put_bytes(f"{key}/{process}", encoded[id(part)])
            return parts[owner]
        with stall_watch.waiting_for(owner):
            payload = self.store.take_bytes(f"{key}/{self.process}")
        if payload is None:
            return END
        return wire.decode(payload, where=where)

    def end(self, key, owner):
        """Hands every process `END` at `key` (called on `owner` alone with
        a store; on every process with a scatter)."""
        parts = [END] * self.processes if self.process == owner else None
        self.give(key, owner, parts)


def gathered(payload, allgather_bytes, where):
    """Every process's value, by index, from each one's `payload`.

    Args:
        payload: this process's value in the wire format, or `b""` for none.
        allgather_bytes: a collective `payload -> [payload of each process]`.
        where: what the values are, for messages (`"PyDataset batch"`).

    Returns:
        A list with each process's decoded value, `None` where it sent none.
    """
    with stall_watch.waiting_for(EVERY_PROCESS):
        payloads = allgather_bytes(payload)
    return [
        wire.decode(made, where=f"{where} from process {process}") if made else None
        for process, made in enumerate(payloads)
    ]


def share_torch_random_state(loader, broadcast_bytes):
    """Process 0's torch random state (or the loader's generator's) on every
    process, so that every process's copy of `loader` shuffles alike.

    Args:
        loader: a `torch.utils.data.DataLoader`.
        broadcast_bytes: a collective `payload -> process 0's payload`.
    """
    import torch

    generator = loader.generator
    state = generator.get_state() if generator is not None else torch.get_rng_state()
    shared = broadcast_bytes(state.numpy().tobytes())
    state = torch.frombuffer(bytearray(shared), dtype=torch.uint8)
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)
