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
        if 8 + length > len(payload):
            raise ValueError(
                f"its header of {length} bytes runs past its {len(payload)} bytes"
            )
        header = json.loads(payload[8 : 8 + length].decode())
        body = memoryview(payload)[8 + length :]
        arrays = [_array(spec, body) for spec in header["arrays"]]
        return _decode(header["tree"], arrays, 0)
    except WireFormatError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as error:
        raise WireFormatError(
            f"{where} is not keras_parallel's data format and was refused: "
            f"{error}. Received: {len(payload)} bytes starting "
            f"{payload[:16]!r}. Nothing in it was run; every process of a run "
            "must be keras_parallel of the same version, on a network only "
            "the run's machines can reach (docs/multihost.md, \"Network and "
            'trust").'
        ) from None


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


def _decode(node, arrays, depth):
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if not isinstance(node, dict) or not node:
        raise ValueError(f"an unknown node {node!r:.40}")
    if "float" in node:
        return float(node["float"])
    if "bytes" in node:
        return arrays[_index(node["bytes"])].tobytes()
    if "array" in node:
        return arrays[_index(node["array"])]
    if "scalar" in node:
        return arrays[_index(node["scalar"])][()]
    if "list" in node or "tuple" in node:
        items = [
            _decode(v, arrays, depth + 1) for v in node.get("list", node.get("tuple"))
        ]
        return items if "list" in node else tuple(items)
    if "keys" in node:
        keys = [_decode(k, arrays, depth + 1) for k in node["keys"]]
        values = [_decode(v, arrays, depth + 1) for v in node["values"]]
        if len(keys) != len(values):
            raise ValueError("a dict with more keys than values")
        return dict(zip(keys, values, strict=True))
    raise ValueError(f"an unknown node {node!r:.40}")


def _index(value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a buffer index {value!r:.20}")
    return value
