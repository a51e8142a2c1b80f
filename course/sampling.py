"""The reference sampler: temperature, then top-k / top-p, then renormalise and sample.

Every function takes logits shaped [V] or [B, V] (float) and returns the same shape.
Filtered-out tokens get logit -inf, so softmax gives them probability exactly 0.
"""
from __future__ import annotations

import math

import torch


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor of shape [V] or [B, V], got {type(logits).__name__}")
    if logits.dim() not in (1, 2) or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [V] or [B, V] with V > 0, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN; check the model output (NaN usually means fp16 overflow)")
    if (logits == float("inf")).any():
        raise ValueError("logits contain +inf; they must be finite or -inf")
    if torch.isneginf(logits).all(dim=-1).any():
        raise ValueError("every logit of a row is -inf: there is no token left to sample")


def check_params(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> None:
    if temperature is None or isinstance(temperature, bool) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 or None = off), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not (0.0 < top_p <= 1.0)):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T. T < 1 sharpens, T > 1 flattens. T = 0 has no softmax; `sample` treats it as argmax."""
    check_params(temperature=temperature)
    if temperature == 0:
        raise ValueError("temperature 0 means greedy decoding: take argmax(logits) instead of rescaling")
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """Keep the k largest logits (ties with the k-th are kept too); k larger than V keeps all."""
    check_params(top_k=k)
    if not k or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | None) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p."""
    check_params(top_p=p)
    if p is None or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above this one
    drop_sorted = mass_before >= p  # the nucleus is already full without this token
    drop_sorted[..., 0] = False  # the top token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def transform_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p: the composition most libraries use."""
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    logits = logits.float()
    if temperature > 0:
        logits = apply_temperature(logits, temperature)
    return top_p_filter(top_k_filter(logits, top_k), top_p)


def probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """The distribution the sampler draws from (renormalised over the kept tokens)."""
    if temperature == 0:
        _check_logits(logits)
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return transform_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw token ids: [V] → scalar tensor, [B, V] → [B]. temperature 0 (or top_k 1) is argmax."""
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [B]
    return ids.reshape(probs.shape[:-1])


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of a distribution (0 for a one-hot, log2(n) for uniform over n)."""
    p = probs.clamp_min(0)
    return -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(-1)
