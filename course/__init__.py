"""What happens inside an LLM call: the importable package behind every notebook.

`import course` imports no torch (course.load does): the grader's sandbox imports it for every submission."""
from __future__ import annotations

from functools import lru_cache

__all__ = ["load"]
__version__ = "0.1.0"


@lru_cache(maxsize=4)
def _load(path, device, dtype):
    from course.engine.tokenizer import load_tokenizer
    from course.engine.weights import load_model

    return load_model(path, device=device, dtype=dtype), load_tokenizer(path)


def load(path=None, device=None, dtype=None):
    """(model, tokenizer) for the course model, or any Llama-family GGUF at `path`, on `device` ("auto" or None:
    a CUDA GPU, else Apple's MPS, else the CPU; course.engine.device.pick_device).

    Loaded once per process for each (path, device, dtype): calling it again in a notebook is free.
    """
    from course.engine.device import pick_device, pick_dtype

    return _load(None if path is None else str(path), str(pick_device(device)), str(pick_dtype(dtype)).split(".")[-1])
