"""The next-token distribution of a prompt, and several sampled continuations of it (the sampling lesson)."""
from __future__ import annotations

import torch

from course.engine.kv_cache import KVCache
from course.engine.sampling import check_params, sample


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's float32 logits [V] for the token after `ids` (one prefill, no cache kept)."""
    with torch.inference_mode():
        tokens = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, T]
        return model(tokens, last_only=True)[0].float().cpu()  # [V]


def sample_continuations(model, tokenizer, prompt_ids: list[int], n: int = 3, max_new_tokens: int = 12, *,
                         temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                         seed: int = 0) -> list[str]:
    """n continuations of one prompt, drawn together as a batch of n rows (one prefill, then decode).

    Every row uses the same settings and one seeded generator, so the same call gives the same texts on
    the same machine. A row stops at the end-of-turn token.
    """
    check_params(temperature, top_k, top_p)
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    device = model.device
    T = len(prompt_ids)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(model.config, batch=n, max_seq_len=T + max_new_tokens, dtype=model.dtype, device=device)
    out = torch.full((n, max_new_tokens), tokenizer.eos_id, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids] * n, dtype=torch.long, device=device)  # [n, T]
        logits = model(ids, start_pos=0, cache=cache, last_only=True)  # [n, V]
        for step in range(max_new_tokens):
            token = sample(logits.float(), temperature, top_k, top_p, generator).cpu()  # [n]
            out[:, step] = torch.where(done, out[:, step], token)
            done |= token == tokenizer.eos_id
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            logits = model(token.view(n, 1).to(device), start_pos=T + step, cache=cache, last_only=True)
    return [tokenizer.decode(row[: _until_eos(row, tokenizer.eos_id)].tolist(), skip_special=True) for row in out]


def _until_eos(row: torch.Tensor, eos_id: int) -> int:
    hits = (row == eos_id).nonzero()
    return int(hits[0]) if len(hits) else len(row)
