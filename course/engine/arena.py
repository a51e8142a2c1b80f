"""One buffer for all of a CPU model's weights, on the kernel's transparent huge pages where Linux offers them.

    from course.engine.arena import pack_parameters
    pack_parameters(model)     # True: every parameter is now a view into one buffer, in the model's order

Why. A decode step reads every weight once, so what it costs is how fast memory streams. With 4 KB pages a
step of the course model (about 540 MB in float32) walks through some 130,000 pages, and every new page is a
translation the CPU must look up (a TLB miss) and a point where its hardware prefetcher stops; with 2 MB pages
it is about 270. The course's weight cache is memory-mapped from disk, and the kernel backs only part of such a
mapping with huge pages (on the course's machines about 210 of 540 MB). Copied into one anonymous buffer that
asks for huge pages (madvise(MADV_HUGEPAGE), see the Linux kernel's admin guide, "Transparent Hugepage
Support"), the products of a step measured 4–8 % faster, side by side, at 1 and 2 threads; and because the
parameters then lie one after another in the model's own order, each layer's q, k and v weights (and its gate
and up weights) are one contiguous block that one product can read (course.engine.fast.fused_block_weights).

The values do not change, nor does anything the eager model computes. Where huge pages are off (or this is
not Linux) nothing is moved: a copy on small pages measured slower than the memory-mapped original.
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


def _parameters(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())  # a tied head once


def is_packed(model: nn.Module) -> bool:
    """Every parameter is a contiguous view into one and the same buffer."""
    params = _parameters(model)
    if not params:
        return False
    ptr = params[0].untyped_storage().data_ptr()
    return all(p.is_contiguous() and p.untyped_storage().data_ptr() == ptr for p in params)


@torch.no_grad()
def pack_parameters(model: nn.Module) -> bool:
    """Move every parameter of a CPU model into one huge-page buffer, in the model's parameter order, in place.

    Each parameter becomes a view of its stretch of the buffer (starting on a 64-byte boundary), with the same
    values; the memory it held is freed unless something else holds it. Returns True when the model is packed
    (now or already); False, moving nothing, when it is not on the CPU, mixes dtypes, or huge pages are off.
    """
    params = _parameters(model)
    if not params or any(p.device.type != "cpu" for p in params) or len({p.dtype for p in params}) != 1:
        return False
    if is_packed(model):
        return True
    sizes = _stretches(params)
    arena = huge_page_tensor(sum(sizes), params[0].dtype)
    if arena is None:
        return False
    move_into(params, arena, sizes)
    return True


def _stretches(params: list[nn.Parameter]) -> list[int]:
    """Elements each parameter takes in the buffer: its own, rounded up so the next starts on a cache line."""
    align = max(1, ALIGN_BYTES // params[0].element_size())
    return [-(-p.numel() // align) * align for p in params]


@torch.no_grad()
def materialize_packed(model: nn.Module) -> bool:
    """Give a model built on the meta device its CPU memory as one huge-page buffer, laid out as pack_parameters
    lays it out, without a first copy on small pages: parameters (a tied one once, so it stays tied) become views
    of the buffer, uninitialised, and buffers get zeroed CPU memory. Returns False, changing nothing, where the
    parameters are not all meta tensors of one dtype or huge pages are off (then use model.to_empty).

    Why not to_empty and then pack_parameters: that writes every weight twice, first on small pages and then into
    the buffer; on the course's AMD EPYC host (a virtual machine) building and packing TinyLlama-1.1B in float32
    took 25 s that way, and 3–8 s this way, most of it Linux faulting in the buffer's huge pages.
    """
    params = _parameters(model)
    if not params or any(not p.is_meta for p in params) or len({p.dtype for p in params}) != 1:
        return False
    sizes = _stretches(params)
    flat = huge_page_tensor(sum(sizes), params[0].dtype)
    if flat is None:
        return False
    homes, start = {}, 0
    for p, size in zip(params, sizes):
        homes[id(p)] = nn.Parameter(flat[start:start + p.numel()].view(p.shape), requires_grad=p.requires_grad)
        start += size
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = homes[id(p)]
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    return True


@torch.no_grad()
def move_into(params: list[nn.Parameter], flat: torch.Tensor, sizes: list[int] | None = None) -> None:
    """Copy each parameter into the next stretch of the 1-D tensor `flat` (sizes[i] elements for parameter i; None:
    exactly its own, so that they lie back to back) and make the parameter a view of it, in place."""
    start = 0
    for i, p in enumerate(params):
        home = flat[start:start + p.numel()].view(p.shape)
        home.copy_(p.detach())
        p.data = home
        start += p.numel() if sizes is None else sizes[i]
