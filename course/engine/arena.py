"""One buffer for all of a CPU model's weights, on the kernel's transparent huge pages where Linux offers them.

    from course.engine.arena import pack_parameters
    pack_parameters(model)     # True: every parameter is now a view into one buffer, values unchanged

Why. A decode step reads every weight once, so it costs what streaming memory costs, and every new page it touches
is an address translation the CPU must look up (a TLB miss; dearer in a virtual machine). With 4 KB pages a step of
the course model (about 540 MB in float32) touches some 130,000 pages, with 2 MB pages about 270 (the Linux kernel's
admin guide, "Transparent Hugepage Support"). What it bought is in course/engine/fast.py's table and
docs/benchmarks.md. The memory probe (course.measure.timing) reads a huge-page buffer too, so the floor is read
from the same kind of memory. Where huge pages are off (or this is not Linux) nothing moves.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN_BYTES = 64  # each parameter starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """True where Linux gives transparent huge pages to a mapping that asks for them (setting always or madvise)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def huge_page_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised 1-D CPU tensor of `numel` elements on memory that asks for huge pages (2 MB aligned),
    or None where they are not offered. The memory lives as long as the tensor (or a view of it) does."""
    if numel <= 0 or not huge_pages_offered():
        return None
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first write: the pages are faulted in huge
    except OSError:
        region.close()
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype)


def is_packed(model: nn.Module) -> bool:
    """Every parameter is a view into one and the same buffer."""
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return len(ptrs) == 1


@torch.no_grad()
def pack_parameters(model: nn.Module) -> bool:
    """Move every parameter of a CPU model into one huge-page buffer, in the model's parameter order, in place.

    Each parameter becomes a view of its stretch of the buffer (starting on a 64-byte boundary), with the same
    values, and the memory it held is freed (unless something else holds it): parameter by parameter, so the model
    never takes twice its memory. Returns True when the model is packed (now or already); False, moving nothing,
    when it is not on the CPU, mixes dtypes, or huge pages are off.
    """
    params = list({id(p): p for p in model.parameters()}.values())  # a tied head once
    if not params or any(p.device.type != "cpu" for p in params) or len({p.dtype for p in params}) != 1:
        return False
    if is_packed(model):
        return True
    align = max(1, ALIGN_BYTES // params[0].element_size())
    sizes = [-(-p.numel() // align) * align for p in params]
    arena = huge_page_tensor(sum(sizes), params[0].dtype)
    if arena is None:
        return False
    start = 0
    for p, size in zip(params, sizes):
        home = arena[start:start + p.numel()].view(p.shape)
        home.copy_(p.detach())
        p.data = home
        start += size
    return True
