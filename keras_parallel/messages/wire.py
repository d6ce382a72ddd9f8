"""Values sent between processes, as data: arrays with a fixed header.

What one process of a run sends another (a batch's rows, the host random
state, a value every process must agree on) travels in this format, never
pickled: a value from the network is decoded as numbers, and nothing in it
can name code to run. A payload is

    b"KPW1" | header length (4 bytes, big-endian) | header (JSON) | buffers

The header holds the value's tree (lists, tuples, dicts, `None`, booleans,
numbers and strings as themselves; each array and `bytes` value as the
index of a buffer) and each buffer's dtype, shape, offset and size. Only
numeric, boolean and fixed-width string dtypes decode; object arrays are
refused on both sides.

Decoding is bounded by what was received: the buffers lie one after
another, without gaps or overlaps, and fill the body exactly (a decoded
value is never larger than its payload: a header pointing many buffers at
one body was a 236 KB payload decoding to 201 MB); the header is at most
`MAX_HEADER_BYTES`, its buffers at most `MAX_BUFFERS`, its nesting at most
`MAX_DEPTH`; a length read from another process is at most
`MAX_PAYLOAD_BYTES` (`checked_length`).

Example:

```python
payload = wire.encode({"x": np.ones((2, 3), "float32"), "rows": 2})
wire.decode(payload, where="batch 0 from process 1")
```
"""

import json
import struct

import numpy as np

MAGIC = b"KPW1"
_LENGTH = struct.Struct(">I")
#: NumPy dtype kinds a payload may hold: booleans, integers, floats,
#: complex numbers, fixed-width strings. Never objects ("O") or records ("V").
_KINDS = frozenset("biufcUS")
#: Nesting deeper than this is refused (a crafted header cannot recurse
#: the decoder out of its stack).
MAX_DEPTH = 64
#: The largest header decoded: the tree and the buffers' specs of a batch
#: of thousands of arrays take a few hundred KB.
MAX_HEADER_BYTES = 16 * 2**20
#: The most buffers one payload may hold.
MAX_BUFFERS = 2**16
#: The largest payload a process accepts a length for (a collective's
#: length prefix, read before the bytes): 2 GiB, the most an int32 length
#: says.
MAX_PAYLOAD_BYTES = 2**31 - 1


class WireFormatError(ValueError):
    """A payload from another process is not keras_parallel's data format."""


def encode(value):
    """`value` as bytes in the wire format.

    Args:
        value: a nest of lists, tuples and dicts (keys: strings, numbers,
            `None` or booleans) of arrays (NumPy's, or any with
            `__array__`: sent as NumPy arrays), NumPy scalars, `bytes`,
            Python numbers, strings, booleans and `None`.

    Returns:
        The payload (`bytes`).

    Raises:
        TypeError: `value` holds something else (an object array, a class
            instance): such a value cannot be sent as data.
    """
    buffers = []
    tree = _encode(value, buffers, 0)
    arrays, offset = [], 0
    for array in buffers:
        arrays.append(
            {
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "offset": offset,
                "nbytes": array.nbytes,
            }
        )
        offset += array.nbytes
    header = json.dumps({"tree": tree, "arrays": arrays}).encode()
    return b"".join(
        [MAGIC, _LENGTH.pack(len(header)), header]
        + [np.ascontiguousarray(a).tobytes() for a in buffers]
    )


def decode(payload, where="a value"):
    """The value `encode` made `payload` from; nothing in it is run.

    Args:
        payload: bytes received from another process.
        where: what the payload is and who sent it, for the error (the key,
            the sending process).

    Returns:
        The value: arrays come back as NumPy arrays, tuples as tuples.

    Raises:
        WireFormatError: `payload` is not in the format (a pickle, a
            truncated or altered header, a buffer outside the payload, an
            object dtype). Nothing from it was run.
    """
    payload = bytes(payload)
    try:
        if payload[:4] != MAGIC:
            raise ValueError(f"it starts with {payload[:4]!r}, not {MAGIC!r}")
        if len(payload) < 8:
            raise ValueError("it ends inside its header length")
        (length,) = _LENGTH.unpack(payload[4:8])
        if length > MAX_HEADER_BYTES:
            raise ValueError(
                f"its header of {length} bytes is over {MAX_HEADER_BYTES} bytes"
            )
        if 8 + length > len(payload):
            raise ValueError(
                f"its header of {length} bytes runs past its {len(payload)} bytes"
            )
        header = json.loads(payload[8 : 8 + length].decode())
        body = memoryview(payload)[8 + length :]
        specs = _contiguous(header["arrays"], len(body))
        arrays = [_array(spec, body) for spec in specs]
        return _decode(header["tree"], arrays, 0, set())
    except WireFormatError:
        raise
    except RecursionError:
        # JSON nested past Python's recursion limit: refused, not a crash.
        raise _refused(where, payload, "its header is nested too deep") from None
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as error:
        raise _refused(where, payload, error) from None


def _refused(where, payload, why):
    return WireFormatError(
        f"{where} is not keras_parallel's data format and was refused: "
        f"{why}. Received: {len(payload)} bytes starting "
        f"{payload[:16]!r}. Nothing in it was run; every process of a run "
        "must be keras_parallel of the same version, on a network only "
        "the run's machines can reach (docs/multihost.md, \"Network and "
        'trust").'
    )


def checked_length(length, where):
    """A length another process sent before its bytes, refused past
    `MAX_PAYLOAD_BYTES` (or below 0) before anything is allocated for it.

    Args:
        length: the length received (any integer).
        where: what it is and who sent it, for the error.

    Returns:
        `length`, as an `int`.

    Raises:
        WireFormatError: the length is negative or over the bound.
    """
    length = int(length)
    if not 0 <= length <= MAX_PAYLOAD_BYTES:
        raise WireFormatError(
            f"{where} announced {length} bytes, outside 0..{MAX_PAYLOAD_BYTES}, "
            "and was refused before anything was allocated. Received: a "
            f"length of {length}; every process of a run must be keras_parallel "
            'of the same version (docs/multihost.md, "Network and trust").'
        )
    return length


def _contiguous(specs, body_size):
    """The buffers' specs, checked to lie one after another and fill the
    body exactly: no byte decodes twice."""
    if not isinstance(specs, list) or len(specs) > MAX_BUFFERS:
        raise ValueError(f"a list of at most {MAX_BUFFERS} buffers is expected")
    offset = 0
    for spec in specs:
        if int(spec["offset"]) != offset:
            raise ValueError(
                f"a buffer at {spec['offset']!r:.20}, where the one before ended "
                f"at {offset}: buffers lie one after another"
            )
        offset += int(spec["nbytes"])
    if offset != body_size:
        raise ValueError(
            f"buffers of {offset} bytes in a body of {body_size}: they must fill it"
        )
    return specs


def _encode(value, buffers, depth):
    if depth > MAX_DEPTH:
        raise TypeError(f"a value nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):
        # JSON keeps ints exact and floats as repr (NaN and infinities too).
        return {"float": value} if isinstance(value, float) else value
    if hasattr(value, "__array__") and not isinstance(value, np.ndarray):
        value = np.asarray(value)  # A JAX, TensorFlow or torch array's values.
    if isinstance(value, (bytes, bytearray)):
        buffers.append(np.frombuffer(bytes(value), np.uint8))
        return {"bytes": len(buffers) - 1}
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind not in _KINDS:
            raise TypeError(
                f"an array of dtype {array.dtype} cannot be sent as data. "
                f"Received: dtype={array.dtype}; send numbers, booleans or "
                "fixed-width strings"
            )
        buffers.append(array)
        kind = "array" if isinstance(value, np.ndarray) else "scalar"
        return {kind: len(buffers) - 1}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, buffers, depth + 1) for v in value]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if isinstance(value, dict):
        keys = list(value)
        for key in keys:
            if not (key is None or isinstance(key, (str, int, float, bool))):
                raise TypeError(f"a dict key of type {type(key).__name__}")
        return {
            "keys": [_encode(k, buffers, depth + 1) for k in keys],
            "values": [_encode(value[k], buffers, depth + 1) for k in keys],
        }
    raise TypeError(
        f"a {type(value).__name__} cannot be sent between processes as data. "
        f"Received: {type(value).__name__}; send arrays, numbers, strings and "
        "nests of lists, tuples and dicts of them"
    )


def _array(spec, body):
    dtype = np.dtype(str(spec["dtype"]))
    if dtype.kind not in _KINDS or dtype.hasobject:
        raise ValueError(f"a buffer of dtype {dtype}")
    shape = tuple(int(n) for n in spec["shape"])
    offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
    if min(shape, default=0) < 0 or int(np.prod(shape)) * dtype.itemsize != nbytes:
        raise ValueError(f"a buffer of {nbytes} bytes for shape {shape} of {dtype}")
    if offset < 0 or offset + nbytes > len(body):
        raise ValueError(f"a buffer at {offset}..{offset + nbytes} past the payload")
    # A copy: the array owns its memory, writable, as an unpickled one was.
    return np.frombuffer(body[offset : offset + nbytes], dtype).reshape(shape).copy()


def _decode(node, arrays, depth, used):
    """The value of `node`; `used`: the buffer indices already decoded (each
    buffer is one value: a tree naming one twice would copy it again)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if not isinstance(node, dict) or not node:
        raise ValueError(f"an unknown node {node!r:.40}")
    if "float" in node:
        return float(node["float"])
    if "bytes" in node:
        return arrays[_index(node["bytes"], used)].tobytes()
    if "array" in node:
        return arrays[_index(node["array"], used)]
    if "scalar" in node:
        return arrays[_index(node["scalar"], used)][()]
    if "list" in node or "tuple" in node:
        items = [
            _decode(v, arrays, depth + 1, used)
            for v in node.get("list", node.get("tuple"))
        ]
        return items if "list" in node else tuple(items)
    if "keys" in node:
        keys = [_decode(k, arrays, depth + 1, used) for k in node["keys"]]
        values = [_decode(v, arrays, depth + 1, used) for v in node["values"]]
        if len(keys) != len(values):
            raise ValueError("a dict with more keys than values")
        return dict(zip(keys, values, strict=True))
    raise ValueError(f"an unknown node {node!r:.40}")


def _index(value, used):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a buffer index {value!r:.20}")
    if value in used:
        raise ValueError(f"buffer {value} named twice: each buffer is one value")
    used.add(value)
    return value
