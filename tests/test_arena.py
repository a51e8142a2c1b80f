"""course/engine/arena.py: a CPU model's weights moved into one huge-page buffer, values and outputs unchanged (the
compiled step does this to every CPU model it is given)."""
from __future__ import annotations

import pytest
import torch

from course.engine import arena
from course.engine.model import tiny_model

needs_huge_pages = pytest.mark.skipif(not arena.huge_pages_offered(), reason="this kernel offers no transparent huge pages")


def _huge_kb(ptr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds address ptr."""
    inside, kb = False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            kb += int(line.split()[1])
    return kb


@needs_huge_pages
def test_a_huge_page_tensor_is_backed_by_huge_pages():
    t = arena.huge_page_tensor(4 << 20, torch.float32)  # 16 MB
    assert t.numel() == 4 << 20 and t.data_ptr() % arena.HUGE_PAGE == 0
    t.fill_(1.0)
    assert _huge_kb(t.data_ptr()) >= 2048  # at least one 2 MB page


@needs_huge_pages
def test_packing_moves_every_parameter_into_one_buffer_and_changes_nothing_it_computes():
    model = tiny_model(seed=4)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.inference_mode():
        before = model(prompt).clone()
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert not arena.is_packed(model)
    assert arena.pack_parameters(model)
    assert arena.is_packed(model)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), values[name]) and p.data_ptr() % arena.ALIGN_BYTES == 0, name
    assert model.output.weight is model.tok_embeddings.weight  # the tied head stays tied
    with torch.inference_mode():
        torch.testing.assert_close(model(prompt), before, atol=0, rtol=0)
    where = model.layers[0].attention.wq.weight.data_ptr()
    assert arena.pack_parameters(model) and model.layers[0].attention.wq.weight.data_ptr() == where  # no second move


def test_nothing_moves_where_huge_pages_are_off_or_dtypes_are_mixed(monkeypatch):
    model = tiny_model(seed=4)
    where = {name: p.data_ptr() for name, p in model.named_parameters()}
    monkeypatch.setattr(arena, "huge_pages_offered", lambda: False)
    assert arena.huge_page_tensor(1024, torch.float32) is None
    assert not arena.pack_parameters(model)
    monkeypatch.undo()
    model.layers[0].attention_norm.weight.data = model.layers[0].attention_norm.weight.data.to(torch.bfloat16)
    where["layers.0.attention_norm.weight"] = model.layers[0].attention_norm.weight.data_ptr()
    assert not arena.pack_parameters(model)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == where
