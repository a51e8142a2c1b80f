"""The course's benchmark suite (`kvcourse bench`, `make bench`): how close the engine runs to this machine's
limits, and how the course around it performs. Bench-only code lives here, outside the `course` package.

ITEMS is the one registration point: item name → Item (bench.core): the function that measures, its title, its
Markdown table and its targets. To add an item, write `run(ctx) -> dict` in a module of this package (bench/core.py
says what ctx offers and what the dict holds) and name it below; `kvcourse bench --list` shows the result.
"""
from __future__ import annotations

from bench import class_grading, course_checks, decode, model, serving
from bench.core import Item

ITEMS: dict[str, Item] = {
    "decode": decode.DECODE,
    "prefill": model.PREFILL,
    "transformers": model.TRANSFORMERS,
    "cache_speedup": model.CACHE_SPEEDUP,
    "load": model.LOAD,
    "notebooks": course_checks.NOTEBOOKS,
    "grading": course_checks.GRADING,
    "widgets": course_checks.WIDGETS,
    "grading_sealed": course_checks.GRADING_SEALED,
    "class_grading": class_grading.CLASS_GRADING,
    "decode_floor": decode.DECODE_FLOOR,
    "decode_batch": decode.DECODE_BATCH,
    "bytes_line": model.BYTES_LINE,
    "batching": serving.BATCHING,
    "serving": serving.SERVING,
    "paged_memory": serving.PAGED_MEMORY,
}
