"""Beam search with a KV cache: the W beams are W rows of one batch, so the cache is W times larger.

Each step scores every (beam, next token) pair by the running sum of log-probabilities, keeps the
best W, and reorders the cache rows so row i holds the history of the beam now in slot i (a beam
that was kept twice is copied, one that was dropped is overwritten). The steps run in the engine's one decode
loop (course.engine.generate.decode_loop), which does the reordering when it is sent (tokens, rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from course.engine.config import whole
from course.engine.generate import decode_loop, prefill, prompt_tensor
from course.engine.kv_cache import KVCache


@dataclass
class BeamResult:
    tokens: list[int]  # the best finished (or, at the length limit, live) beam's new tokens
    score: float  # its summed log-probability
    beams: list[tuple[list[int], float]] = field(default_factory=list)  # every final hypothesis, best first
    width: int = 1
    cache_bytes: int = 0  # measured bytes of the beam search's cache (batch = width)
    single_cache_bytes: int = 0  # measured bytes of a batch-1 cache of the same length (greedy)
    cache_shape: tuple = ()  # one layer's K buffer, [B=width, H_kv, T_max, D_h]

    @property
    def cache_ratio(self) -> float:
        return self.cache_bytes / self.single_cache_bytes


@torch.inference_mode()
def beam_search(model, prompt_ids, width: int = 4, max_new_tokens: int = 24, eos_id: int | None = None,
                use_cache: bool = True) -> BeamResult:
    """Return the highest-scoring continuation of width-W beam search (sum of log-probabilities).

    use_cache=False recomputes every beam's whole sequence each step (the reference the tests
    compare the cache reordering against).
    """
    whole("width (beams)", width)
    whole("max_new_tokens", max_new_tokens)
    device = model.device
    prompt = prompt_tensor(model, prompt_ids, max_new_tokens)  # [1, T]
    T = prompt.shape[1]
    size = T + max_new_tokens
    seqs = prompt.repeat(width, 1)  # [W, T]: every beam starts as the prompt
    cache = KVCache(model.config, width, size, dtype=model.dtype, device=device) if use_cache else None
    scores = torch.full((width,), float("-inf"), device=device)
    scores[0] = 0.0  # one live beam at first, so the W copies of the prompt do not fill the beam with duplicates
    finished: list[tuple[list[int], float]] = []
    loop = decode_loop(model, seqs, max_new_tokens, cache=cache, use_cache=use_cache)  # the engine's decode loop
    logits = next(loop)  # prefill all W rows: [W, V]
    for step in range(max_new_tokens):
        candidates = (scores[:, None] + torch.log_softmax(logits.float(), dim=-1)).view(-1)  # [W·V]
        top_scores, top_index = candidates.topk(2 * width)  # spare candidates replace beams that end
        vocab = logits.shape[-1]
        kept = []  # (parent row, token, score) of the beams that go on
        for s, i in zip(top_scores.tolist(), top_index.tolist()):
            row, token = divmod(i, vocab)
            if s == float("-inf") or len(kept) == width:
                break
            if eos_id is not None and token == eos_id:
                finished.append((seqs[row, T:].tolist() + [token], s))  # a finished hypothesis leaves the beam
            else:
                kept.append((row, token, s))
        if len(finished) >= width or not kept:
            break
        kept += [(kept[0][0], kept[0][1], float("-inf"))] * (width - len(kept))  # dead fillers keep the batch W
        rows = torch.tensor([r for r, _, _ in kept], device=device)
        new = torch.tensor([t for _, t, _ in kept], device=device).view(width, 1)
        seqs = torch.cat([seqs[rows], new], dim=1)  # [W, T + step + 1]
        scores = torch.tensor([s for _, _, s in kept], device=device)
        if step == max_new_tokens - 1:
            break
        # Beams now in slot i descend from old slot rows[i]: the loop reorders the cache rows (or, uncached, the
        # sequences it re-runs), then runs one new token per beam: [W, V].
        logits = loop.send((new, rows))
    loop.close()
    live = [(seqs[i, T:].tolist(), s) for i, s in enumerate(scores.tolist()) if s > float("-inf")]
    hypotheses = sorted(finished + live, key=lambda h: h[1], reverse=True)  # no length penalty: plain sums
    best_tokens, best_score = hypotheses[0]
    single = KVCache(model.config, 1, size, dtype=model.dtype, device="meta").nbytes
    beams = KVCache(model.config, width, size, dtype=model.dtype, device="meta")  # the cache's shape, also uncached
    return BeamResult(best_tokens, best_score, hypotheses, width, beams.nbytes, single, tuple(beams[0].k.shape))


@torch.inference_mode()
def sequence_logprob(model, prompt_ids, new_tokens) -> float:
    """Summed log-probability the model gives new_tokens after the prompt (to compare beam vs greedy)."""
    ids = torch.as_tensor(list(prompt_ids) + list(new_tokens), dtype=torch.long, device=model.device).view(1, -1)
    T = len(prompt_ids)
    logp = torch.log_softmax(prefill(model, ids, cache=None, last_only=False)[0, T - 1:-1].float(), dim=-1)  # [n, V]
    return logp.gather(-1, torch.as_tensor(list(new_tokens), device=model.device).view(-1, 1)).sum().item()
