"""Plain data across the sandbox wall: `encode` (inside, on the learner's value) to tagged JSON, `decode` (in the
grader) back to Python and numpy values, anything malformed refused.

A number travels by value whatever carries it: int, numpy integers and whole Fractions are integers; float and
numpy floats reals; other Fractions stay exact; bool and numpy.bool are booleans; 0-d tensors stay arrays. A
number carried by another type than Python's own decodes as `Number(value, carrier)`, so a hint can name it.
Nothing the learner's code chooses freely comes back as text: a carrier's name is one of NAMES (else "an object
of its own class"), a refusal one of WHY, an exception only the built-in classes it derives from.
"""
from __future__ import annotations

import base64
import builtins
import math
import numbers
from fractions import Fraction

import numpy as np

MAX_ELEMENTS = 2_000_000  # a returned array larger than this is refused (the grader's inputs are small)
MAX_DEPTH = 8
PLAIN_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64"}
NAMES = {"int", "float", "bool", "str", "Fraction", "list", "tuple", "dict", "None", "torch.Tensor",
         "numpy.ndarray"} | {f"numpy.{d}" for d in PLAIN_DTYPES}
WHY = {"object": "an object of its own class, not plain data", "subclass": "a subclass of a plain type",
       "big": f"more than {MAX_ELEMENTS:,} elements", "deep": "nested too deeply", "keys": "a dict with keys that "
       "are not str", "dtype": "an array of a dtype other than bool, integers or floats", "timeout":
       "this check ran past its time limit", "died": "the kernel died in this check", "not run": "not run",
       "malformed": "malformed"}
EXCEPTIONS = {name for name, c in vars(builtins).items() if isinstance(c, type) and issubclass(c, BaseException)}


class Rejected:
    """A value the sandbox refused to hand over (wrong type, too big, ...); equal to nothing."""

    def __init__(self, why: str):
        self.why = why if why in WHY else "malformed"

    def __eq__(self, other):  # (and so unhashable)
        return False

    def __repr__(self):
        return f"<rejected: {WHY[self.why]}>"


class Raised:
    """The learner's code raised: `bases` are the built-in exception classes it derives from, most specific first."""

    def __init__(self, bases: list[str]):
        self.bases = [b for b in bases if b in EXCEPTIONS][:12]

    def __repr__(self):
        return f"<raised {self.bases[:1]}>"


class Array:
    """A decoded array: numpy data plus where it came from (tensor or ndarray)."""

    def __init__(self, data, kind: str):
        self.data, self.kind = data, kind

    def __repr__(self):
        return f"<{self.kind} {self.data.dtype} {list(self.data.shape)}>"


class Number:
    """A number carried by another type than Python's own (numpy.int64, Fraction): its value and that type."""

    def __init__(self, value, carrier: str):
        self.value, self.carrier = value, carrier if carrier in NAMES else "object"

    def __repr__(self):
        return f"<{self.carrier} {self.value!r}>"


def encode(value, depth: int = 0):
    if depth > MAX_DEPTH:
        return {"t": "rejected", "why": "deep"}
    kind = type(value)
    module = getattr(kind, "__module__", "")
    carrier = kind.__name__ if module in ("builtins", "fractions") else f"{module.split('.')[0]}.{kind.__name__}"
    if value is None or kind is str:
        return {"t": "none"} if value is None else {"t": "str", "v": value}
    if kind in (list, tuple):
        return {"t": kind.__name__, "v": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        if not all(type(k) is str for k in value):
            return {"t": "rejected", "why": "keys"}
        return {"t": "dict", "v": {k: encode(v, depth + 1) for k, v in value.items()}}
    if carrier in ("torch.Tensor", "numpy.ndarray"):
        return _array(value, carrier)
    if carrier not in NAMES:  # an object, or a subclass of int whose == says yes to everything: refused
        return {"t": "rejected", "why": "subclass" if isinstance(value, (int, float, str)) else "object"}
    if carrier in ("bool", "numpy.bool"):
        out = {"t": "bool", "v": bool(value)}
    elif isinstance(value, Fraction) and value.denominator != 1:
        out = {"t": "fraction", "v": f"{value.numerator}/{value.denominator}"}
    elif isinstance(value, (numbers.Integral, Fraction)):
        out = {"t": "int", "v": str(int(value))}
    elif isinstance(value, numbers.Real):
        out = {"t": "float", "v": repr(float(value))}
    else:
        return {"t": "rejected", "why": "object"}
    return out if carrier in ("bool", "int", "float") else dict(out, type=carrier)


def _array(value, carrier: str):
    if carrier == "torch.Tensor":
        import torch

        value = value.detach().cpu()
        value = (value.float() if value.dtype == torch.bfloat16 else value).contiguous().numpy()
    if value.size > MAX_ELEMENTS:
        return {"t": "rejected", "why": "big"}
    if value.dtype.name not in PLAIN_DTYPES:
        return {"t": "rejected", "why": "dtype"}
    return {"t": "tensor" if carrier == "torch.Tensor" else "ndarray", "dtype": value.dtype.name,
            "shape": list(value.shape), "b64": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()}


def error(exc: BaseException) -> dict:
    """An exception raised by the learner's code, as the built-in classes it derives from (never its own name)."""
    return {"t": "raised", "builtin_bases": [c.__name__ for c in type(exc).__mro__[:-1]  # not `object`
                                             if getattr(builtins, c.__name__, None) is c][:12]}


def decode(obj, depth: int = 0):
    """Rebuild a value from encode()'s JSON; anything unexpected becomes Rejected."""
    try:
        if not isinstance(obj, dict) or depth > MAX_DEPTH + 1:
            return Rejected("malformed")
        t, v = obj.get("t"), obj.get("v")
        carrier = obj.get("type", t)
        if t == "none":
            return None
        if t == "str" and type(v) is str:
            return v
        if t == "bool" and type(v) is bool:
            return v if carrier == "bool" else Number(v, carrier)
        if t in ("int", "float", "fraction"):
            value = {"int": int, "float": float, "fraction": Fraction}[t](str(v)[:5000])
            return value if carrier in ("int", "float", "fraction") else Number(value, carrier)
        if t in ("list", "tuple"):
            items = [decode(x, depth + 1) for x in v]
            return items if t == "list" else tuple(items)
        if t == "dict":
            return {str(k): decode(x, depth + 1) for k, x in v.items()}
        if t in ("tensor", "ndarray") and obj["dtype"] in PLAIN_DTYPES:
            shape = tuple(int(s) for s in obj["shape"])
            data = np.frombuffer(base64.b64decode(obj["b64"]), dtype=obj["dtype"])
            if data.size == math.prod(shape):
                return Array(data.reshape(shape).copy(), t)
        if t == "raised":
            return Raised([str(b) for b in obj.get("builtin_bases", [])])
        if t == "rejected":
            return Rejected(str(obj.get("why", "")))
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        pass
    return Rejected("malformed")
