"""The next-token distribution of a prompt, and several sampled continuations of it (the sampling lesson)."""
from __future__ import annotations

import torch

from course.engine.generate import decode_loop, prefill, prompt_tensor
from course.engine.sampling import Sampler


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's float32 logits [V] for the token after `ids` (one prefill, no cache kept)."""
    tokens = prompt_tensor(model, [ids])  # [1, T]
    return prefill(model, tokens, cache=None)[0].float().cpu()  # [V]


@torch.inference_mode()
def sample_continuations(model, tokenizer, prompt_ids: list[int], n: int = 3, max_new_tokens: int = 12, *,
                         temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                         seed: int = 0) -> list[str]:
    """n continuations of one prompt, drawn together as a batch of n rows (one prefill, then decode).

    Every row uses the same settings and one seeded generator, so the same call gives the same texts on
    the same machine. A row stops at the end-of-turn token.
    """
    sampler = Sampler(temperature, top_k, top_p, seed=seed, device=model.device, dtype=model.dtype)
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    ids = prompt_tensor(model, [list(prompt_ids)] * n, max_new_tokens)  # [n, T]
    out = torch.full((n, max_new_tokens), tokenizer.eos_id, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    loop = decode_loop(model, ids, max_new_tokens)
    logits = next(loop)
    for step in range(max_new_tokens):
        token, _ = sampler(logits.float())  # [n]
        token = token.cpu()
        out[:, step] = torch.where(done, out[:, step], token)
        done |= token == tokenizer.eos_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = loop.send(token)
    loop.close()
    rows = [row.tolist() for row in out]
    return [tokenizer.decode(row[:row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row, skip_special=True)
            for row in rows]
