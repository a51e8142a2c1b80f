"""Let notebooks report the numbers they measured, so tests can check them (not their printed text).

A notebook cell calls ``record("prefill_tokens_per_s_256", 1234.5)``. When the environment variable
KVCOURSE_RESULTS names a JSON file (the test suite sets it), the value is merged into that file;
otherwise nothing is written. Values must be JSON-serialisable (numbers, strings, lists, dicts).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

_recorded: dict = {}


def record(key: str, value):
    """Remember a measured value under `key` and return it (so a cell can record and display at once)."""
    value = _plain(value)
    _recorded[key] = value
    target = os.environ.get("KVCOURSE_RESULTS")
    if target:
        from course.engine.weights import write_atomically  # not at import: the CLI's progress and review need no torch

        path = Path(target)
        data = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
        data[key] = value
        write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1)))
    return value


def record_all(values: dict) -> dict:
    """record() every key of `values`, and return them."""
    for key, value in values.items():
        record(key, value)
    return values


def record_gated(key: str, run, value=None):
    """Record a gated measurement (course.measure.gates.Measured): its value when it passed its physics gate;
    otherwise only its name, under "unreliable", so no recap, quiz or review card can quote it."""
    if run.ok:
        return record(key, run.value if value is None else value)
    record("unreliable", sorted({*_recorded.get("unreliable", []), key}))
    record("busy_notices", list(dict.fromkeys([*_recorded.get("busy_notices", []), run.notice])))  # each once
    return None


def recorded() -> dict:
    return dict(_recorded)


FULL_VAR = "KVCOURSE_FULL"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def full_size() -> bool:
    """True when KVCOURSE_FULL is 1/true/yes/on: notebooks run their full sweeps instead of the quick default
    sizes; 0/false/no/off or unset/empty: the quick sizes. The one reader of the variable (the bytes line uses
    it too), so no two places disagree; anything else raises ValueError rather than guessing."""
    text = os.environ.get(FULL_VAR, "").strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"{FULL_VAR} must be one of {'/'.join(_ON)} (full sweeps) or {'/'.join(_OFF[1:])} or empty "
                     f"(quick sizes), got {os.environ[FULL_VAR]!r}: fix or unset it and restart the kernel")


def _plain(value):
    try:
        import numpy as np
        import torch

        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
