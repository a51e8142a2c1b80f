"""Plain data across the sandbox wall: what a learner's function returned, as tagged JSON.

`encode` runs inside the sandbox on the learner's return value and accepts only exact types: int, float,
bool, str, None, list/tuple/dict (str keys) of those, and numpy arrays / torch tensors of plain dtypes.
A subclass (an `int` whose `==` is always true), a tensor subclass, or any other object is recorded as
{"t": "rejected"}, which no comparison accepts. `decode` runs in the clean grader process and rebuilds
Python and numpy values from the JSON alone, rejecting anything malformed.
"""
from __future__ import annotations

import base64
import math

MAX_ELEMENTS = 2_000_000  # a returned array larger than this is refused (the grader's inputs are small)
MAX_DEPTH = 8
PLAIN_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"}


class Rejected:
    """A value the sandbox refused to hand over (wrong type, subclass, too big); equal to nothing."""

    def __init__(self, why: str):
        self.why = why

    def __eq__(self, other):
        return False

    __hash__ = None

    def __repr__(self):
        return f"<rejected: {self.why}>"


def encode(value, depth: int = 0):
    kind = type(value)
    if depth > MAX_DEPTH:
        return {"t": "rejected", "why": "nested too deeply"}
    if value is None or kind in (bool, str):
        return {"t": kind.__name__ if value is not None else "none", "v": value}
    if kind is int:
        return {"t": "int", "v": str(value)}
    if kind is float:
        return {"t": "float", "v": repr(value)}
    if kind in (list, tuple):
        return {"t": kind.__name__, "v": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        if not all(type(k) is str for k in value):
            return {"t": "rejected", "why": "dict keys must be str"}
        return {"t": "dict", "v": {k: encode(v, depth + 1) for k, v in value.items()}}
    module = getattr(kind, "__module__", "") or ""
    if module.startswith("torch") and kind.__name__ == "Tensor":
        import torch

        if kind is not torch.Tensor:
            return {"t": "rejected", "why": f"a {kind.__name__} subclass, not a plain tensor"}
        t = value.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.numel() > MAX_ELEMENTS:
            return {"t": "rejected", "why": f"a tensor of {t.numel()} elements"}
        return _array(t.contiguous().numpy(), "tensor")
    if module == "numpy" and kind.__name__ == "ndarray":
        import numpy as np

        if kind is not np.ndarray:
            return {"t": "rejected", "why": "an ndarray subclass"}
        if value.size > MAX_ELEMENTS:
            return {"t": "rejected", "why": f"an array of {value.size} elements"}
        return _array(np.ascontiguousarray(value), "ndarray")
    return {"t": "rejected", "why": f"type {module}.{kind.__qualname__} is not plain data"}


def _array(arr, tag: str):
    if arr.dtype.name not in PLAIN_DTYPES:
        return {"t": "rejected", "why": f"dtype {arr.dtype.name}"}
    return {"t": tag, "dtype": arr.dtype.name, "shape": list(arr.shape),
            "b64": base64.b64encode(arr.tobytes()).decode()}


def error(exc: BaseException) -> dict:
    """An exception raised by the learner's code, by class name and the builtin classes it derives from."""
    import builtins

    mro = [c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c]
    return {"t": "raised", "name": type(exc).__name__, "builtin_bases": mro[:12], "message": str(exc)[:300]}


class Raised:
    def __init__(self, name: str, bases: list[str], message: str):
        self.name, self.bases, self.message = name, bases, message

    def __repr__(self):
        return f"<raised {self.name}: {self.message[:80]}>"


class Array:
    """A decoded array: numpy data plus where it came from (tensor or ndarray)."""

    def __init__(self, data, kind: str):
        self.data, self.kind = data, kind

    def __repr__(self):
        return f"<{self.kind} {self.data.dtype} {list(self.data.shape)}>"


def decode(obj, depth: int = 0):
    """Rebuild a value from encode()'s JSON; anything unexpected becomes Rejected."""
    import numpy as np

    try:
        if not isinstance(obj, dict) or depth > MAX_DEPTH + 1:
            return Rejected("malformed")
        t = obj.get("t")
        if t == "none":
            return None
        if t in ("bool", "str"):
            v = obj["v"]
            return v if type(v) is {"bool": bool, "str": str}[t] else Rejected("malformed")
        if t == "int":
            return int(str(obj["v"])[:5000])
        if t == "float":
            return float(str(obj["v"])) if str(obj["v"]) not in ("nan", "inf", "-inf") else float(obj["v"])
        if t in ("list", "tuple"):
            items = [decode(v, depth + 1) for v in obj["v"]]
            return items if t == "list" else tuple(items)
        if t == "dict":
            return {str(k): decode(v, depth + 1) for k, v in obj["v"].items()}
        if t in ("tensor", "ndarray"):
            dtype = obj["dtype"]
            if dtype not in PLAIN_DTYPES:
                return Rejected("dtype")
            shape = tuple(int(s) for s in obj["shape"])
            data = np.frombuffer(base64.b64decode(obj["b64"]), dtype=dtype)
            if data.size != (math.prod(shape) if shape else 1):
                return Rejected("shape does not match the data")
            return Array(data.reshape(shape).copy(), t)
        if t == "raised":
            return Raised(str(obj["name"])[:100], [str(b) for b in obj.get("builtin_bases", [])][:12],
                          str(obj.get("message", ""))[:300])
        if t == "rejected":
            return Rejected(str(obj.get("why", ""))[:200])
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    return Rejected("malformed")
