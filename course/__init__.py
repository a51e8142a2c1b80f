"""What happens inside an LLM call: the importable package behind every notebook.

torch is imported on first use (course.load, course.pick_device), not by `import course`: the grader's sandbox
imports this package for every submission, and the exercises that need no tensors should not pay ~1.5 s for it."""
from __future__ import annotations

from functools import lru_cache

from course.engine.config import PRESETS, ModelConfig

__all__ = ["ModelConfig", "PRESETS", "load", "pick_device", "pick_dtype"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("pick_device", "pick_dtype"):
        from course.engine import device

        return getattr(device, name)
    raise AttributeError(f"module 'course' has no attribute {name!r}")


@lru_cache(maxsize=4)
def _load(path, device, dtype):
    from course.engine.tokenizer import load_tokenizer
    from course.engine.weights import load_model

    return load_model(path, device=device, dtype=dtype), load_tokenizer(path)


def load(path=None, device=None, dtype=None):
    """(model, tokenizer) for the course model, or any Llama-family GGUF at `path`.

    Loaded once per process for each (path, device, dtype): calling it again in a notebook is free.
    """
    from course.engine.device import pick_device, pick_dtype

    return _load(None if path is None else str(path), str(pick_device(device)), str(pick_dtype(dtype)).split(".")[-1])
