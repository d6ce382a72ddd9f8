"""Values between processes as data (`keras_parallel.messages.wire`)."""

import json
import os
import pickle
import re

import numpy as np
import pytest

from keras_parallel.messages import wire
from keras_parallel.messages.wire import WireFormatError


def test_a_batch_and_the_host_random_state_come_back_equal():
    import random

    value = {
        "x": np.arange(12, dtype="float32").reshape(3, 4),
        "y": (np.array([1, 2, 3], "int64"), None),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "torch": bytes(range(7)),
        "names": np.array(["a", "bc"]),
        "flags": [True, False],
        "scalar": np.float32(2.5),
        "nan": float("nan"),
        1: "an int key",
    }
    back = wire.decode(wire.encode(value))
    assert set(back) == set(value)
    np.testing.assert_array_equal(back["x"], value["x"])
    assert back["x"].dtype == np.float32 and back["x"].flags.writeable
    assert isinstance(back["y"], tuple) and back["y"][1] is None
    assert back["numpy"][0] == "MT19937"
    np.testing.assert_array_equal(back["numpy"][1], value["numpy"][1])
    assert back["python"][0] == value["python"][0]
    assert tuple(back["python"][1]) == value["python"][1]
    assert back["torch"] == value["torch"]
    assert back["names"].tolist() == ["a", "bc"]
    assert back["flags"] == [True, False]
    assert back["scalar"] == np.float32(2.5) and back["scalar"].dtype == np.float32
    assert np.isnan(back["nan"]) and back[1] == "an int key"


def test_an_object_or_a_class_instance_is_refused_before_sending():
    with pytest.raises(TypeError, match="dtype object"):
        wire.encode(np.array([{}], dtype=object))
    with pytest.raises(TypeError, match="cannot be sent between processes"):
        wire.encode({"x": object()})


class _Payload:
    """What a crafted pickle would run: it creates a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    crafted = pickle.dumps(_Payload(str(marker)))
    with pytest.raises(WireFormatError, match="batch 3 from process 1"):
        wire.decode(crafted, where="batch 3 from process 1")
    assert not marker.exists()
    pickle.loads(crafted)  # The same bytes, unpickled, would have run.
    assert marker.exists()
    os.remove(marker)


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "header past the end",
        "buffer past the end",
        "object dtype",
        "negative index",
        "not JSON",
        "too deep",
    ],
)
def test_a_damaged_payload_is_refused_naming_where_it_came_from(damage):
    good = wire.encode({"x": np.ones((2, 2), "float32")})
    header_length = int.from_bytes(good[4:8], "big")
    header = json.loads(good[8 : 8 + header_length])
    body = good[8 + header_length :]

    def made(new_header, new_body=body):
        raw = json.dumps(new_header).encode()
        return wire.MAGIC + len(raw).to_bytes(4, "big") + raw + new_body

    if damage == "truncated":
        payload = good[: len(good) - 3]
    elif damage == "header past the end":
        payload = wire.MAGIC + (10**6).to_bytes(4, "big") + good[8:]
    elif damage == "buffer past the end":
        header["arrays"][0]["offset"] = 8
        payload = made(header)
    elif damage == "object dtype":
        header["arrays"][0]["dtype"] = "|O"
        payload = made(header)
    elif damage == "negative index":
        header["tree"]["values"][0] = {"array": -1}
        payload = made(header)
    elif damage == "not JSON":
        payload = wire.MAGIC + (4).to_bytes(4, "big") + b"{{{{" + body
    else:
        deep = {"list": []}
        node = deep
        for _ in range(wire.MAX_DEPTH + 2):
            node["list"].append({"list": []})
            node = node["list"][0]
        payload = made({"tree": deep, "arrays": []})
    with pytest.raises(WireFormatError, match="key 'k' from process 2"):
        wire.decode(payload, where="key 'k' from process 2")


def _payload(header, body=b""):
    raw = json.dumps(header).encode()
    return wire.MAGIC + len(raw).to_bytes(4, "big") + raw + body


def test_buffers_pointing_at_one_body_are_refused_before_any_copy():
    # 236 KB that decoded to 201 MB: many buffers over the same bytes.
    body = bytes(2**16)
    spec = {"dtype": "|u1", "shape": [2**16], "offset": 0, "nbytes": 2**16}
    header = {
        "tree": {"list": [{"array": i} for i in range(1000)]},
        "arrays": [spec] * 1000,
    }
    with pytest.raises(WireFormatError, match="buffers lie one after another"):
        wire.decode(_payload(header, body))


def test_one_buffer_named_twice_in_the_tree_is_refused():
    body = bytes(2**16)
    spec = {"dtype": "|u1", "shape": [2**16], "offset": 0, "nbytes": 2**16}
    header = {"tree": {"list": [{"bytes": 0}] * 1000}, "arrays": [spec]}
    with pytest.raises(WireFormatError, match="buffer 0 named twice"):
        wire.decode(_payload(header, body))


def test_bytes_after_the_buffers_are_refused():
    good = wire.encode(np.ones(4, "float32"))
    with pytest.raises(WireFormatError, match="they must fill it"):
        wire.decode(good + b"extra")


def test_a_header_nested_past_the_recursion_limit_is_refused():
    raw = b"[" * 200_000 + b"]" * 200_000
    payload = wire.MAGIC + len(raw).to_bytes(4, "big") + raw
    with pytest.raises(WireFormatError, match="nested too deep"):
        wire.decode(payload, where="key 'k' from process 1")


def test_a_header_over_its_bound_is_refused_before_it_is_parsed():
    payload = wire.MAGIC + (wire.MAX_HEADER_BYTES + 1).to_bytes(4, "big") + b"{}"
    with pytest.raises(WireFormatError, match="over"):
        wire.decode(payload)


def test_more_buffers_than_the_bound_are_refused():
    spec = {"dtype": "|u1", "shape": [0], "offset": 0, "nbytes": 0}
    header = {"tree": None, "arrays": [spec] * (wire.MAX_BUFFERS + 1)}
    with pytest.raises(WireFormatError, match="at most"):
        wire.decode(_payload(header))


@pytest.mark.parametrize("length", [-1, wire.MAX_PAYLOAD_BYTES + 1, 2**62])
def test_a_length_prefix_out_of_bounds_is_refused(length):
    with pytest.raises(WireFormatError, match="refused before anything"):
        wire.checked_length(length, "a value broadcast by process 1")
    assert wire.checked_length(12, "a value") == 12


#: Where keras_parallel may still pickle, and why none of it comes from the
#: network.
PICKLING_ALLOWED = {
    # The parent of `keras_parallel.launch` reads its own children's return
    # values and errors through multiprocessing's queue (a local pipe
    # between the parent and the children it forked or spawned).
    "launcher/torch_processes.py": ("pickle.loads", "pickle.dumps", "SimpleQueue"),
}
#: Explicit pickling, and the calls that unpickle by themselves: torch's
#: object collectives, multiprocessing's queues and connections, NumPy's
#: object arrays; `torch.load` is checked apart (with `weights_only=True`
#: it unpickles tensors only).
FORBIDDEN = (
    "pickle.loads",
    "pickle.load(",
    "pickle.dumps",
    "cloudpickle",
    "_object_list",
    "gather_object",
    "broadcast_object",
    "scatter_object",
    "SimpleQueue",
    "multiprocessing.Queue",
    ".recv(",
    "multiprocessing.connection",
    ".Pipe(",
    "allow_pickle=True",
)


def test_nothing_received_from_another_process_is_unpickled():
    import io
    import pathlib
    import tokenize

    import keras_parallel

    root = pathlib.Path(keras_parallel.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        # Code only: comments and strings (docstrings) may name them.
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        code = "".join(
            t.string if t.type not in (tokenize.COMMENT, tokenize.STRING) else " "
            for t in tokens
        )
        for word in FORBIDDEN:
            if word in code and word not in PICKLING_ALLOWED.get(name, ()):
                found.append(f"{name}: {word}")
        for call in re.finditer(r"torch\.load\(([^)]*)\)", code):
            if "weights_only=True" not in call.group(1).replace(" ", ""):
                found.append(f"{name}: torch.load without weights_only=True")
    assert not found, found


@pytest.mark.parametrize(
    "line",
    [
        "dist.all_gather_object(out, value)",
        "queue = multiprocessing.SimpleQueue()",
        "state = torch.load(path)",
        "data = conn.recv()",
    ],
)
def test_the_no_pickle_check_finds_implicit_unpickling(line, tmp_path, monkeypatch):
    # The check above, on a package holding one such line, goes red.
    import keras_parallel

    package = tmp_path / "keras_parallel"
    package.mkdir()
    (package / "module.py").write_text(line + "\n")
    monkeypatch.setattr(keras_parallel, "__file__", str(package / "__init__.py"))
    with pytest.raises(AssertionError, match="module.py"):
        test_nothing_received_from_another_process_is_unpickled()
