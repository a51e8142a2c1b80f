"""The reference sampler: temperature, then top-k / top-p, then renormalise and sample.

    apply_temperature   logits / T             T < 1 sharpens, T > 1 flattens, T = 0 means greedy (argmax)
    top_k_filter        keep the k largest     k = 1 is greedy; k >= V keeps everything
    top_p_filter        keep the nucleus       the smallest set of top tokens whose probability reaches p
    transform_logits    all three, in that order (the order transformers' generate() uses)
    probabilities       softmax of what is left: the distribution `sample` draws from
    sample              one draw per row, from a seeded torch.Generator

Every function takes logits shaped [V] or [B, V] (float) and returns the same shape; rows are
independent. Filtered-out tokens get logit -inf, so softmax gives them probability exactly 0 and
torch.multinomial can never pick them.

Ties: a filter never splits tokens whose logits are exactly equal. top-k keeps every token tied with
the k-th (as transformers does); top-p keeps every token tied with the last token the nucleus needs,
so which of two equal tokens survives never depends on its position in the vocabulary. The one
exception is greedy decoding (temperature 0), which must pick a single token: argmax takes the lowest
id among tied maxima.
"""
from __future__ import annotations

import math
import numbers

import torch


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor of shape [V] or [B, V], got {type(logits).__name__}")
    if logits.dim() not in (1, 2) or logits.shape[-1] == 0 or logits.numel() == 0:
        raise ValueError(f"logits must have shape [V] or [B, V] with V >= 1 and B >= 1, got {tuple(logits.shape)}; "
                         "for a model's [B, T, V] output take the last position: logits[:, -1]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}; convert with logits.float()")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN; check the model output (NaN usually means fp16 overflow)")
    if torch.isposinf(logits).any():
        raise ValueError("logits contain +inf; they must be finite or -inf (-inf = a token that is ruled out)")
    if torch.isneginf(logits).all(dim=-1).any():
        raise ValueError("logits: every logit of a row is -inf, so there is no token left to sample")


def check_params(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """Raise ValueError, naming the argument and its valid range, for a setting the sampler cannot use."""
    if (temperature is None or isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 or None = off), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 or None = off), got {top_p!r}")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T. T < 1 sharpens, T > 1 flattens. T = 0 has no softmax; `sample` treats it as argmax."""
    check_params(temperature=temperature)
    if temperature == 0:
        raise ValueError("temperature 0 means greedy decoding: take argmax(logits) instead of rescaling "
                         "(sample() and probabilities() do that for you)")
    scaled = logits / temperature
    if torch.isposinf(scaled).any():
        # A tiny T overflowed float32. Softmax ignores a constant shift, so divide the gaps to the max instead.
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return scaled


def top_k_filter(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """Keep the k largest logits (ties with the k-th are kept too); k larger than V keeps all."""
    check_params(top_k=k)
    if not k or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, int(k), dim=-1).values[..., -1:]  # [..., 1] the k-th largest logit
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | None) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p.

    A token is kept when the tokens ranked above it hold less than p of the mass. The top token always
    stays, so a tiny p is greedy; tokens tied with the last kept one stay too.
    """
    check_params(top_p=p)
    if p is None or p >= 1.0:
        return logits
    if bool((logits[..., 1:] <= logits[..., :-1]).all()):
        sorted_logits = logits  # already most likely first (a widget caches sorted logits): skip the sort
    else:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [..., V]
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)  # mass ranked above
    n_keep = (mass_before < p).sum(dim=-1, keepdim=True).clamp_min(1)  # [..., 1] the nucleus size
    threshold = sorted_logits.gather(-1, n_keep - 1)  # [..., 1] the smallest logit the nucleus needs
    return logits.masked_fill(logits < threshold, float("-inf"))


def transform_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p: the composition transformers' generate() uses.

    temperature 0 leaves the logits unscaled here (greedy has no distribution to reshape).
    """
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    logits = logits.float()
    if temperature > 0:
        logits = apply_temperature(logits, temperature)
    return top_p_filter(top_k_filter(logits, top_k), top_p)


def probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """The distribution the sampler draws from (renormalised over the kept tokens). Same shape as logits.

    temperature 0 gives a one-hot on the argmax (the lowest id if the largest logits tie).
    """
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return transform_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


def kept_mask(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
              top_p: float | None = None) -> torch.Tensor:
    """Boolean mask of the tokens the settings keep: the argmax alone at temperature 0, else every token
    top-k and top-p leave a finite logit (a kept token far below the top may still round to probability 0)."""
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).bool()
    return torch.isfinite(transform_logits(logits, temperature, top_k, top_p))


def nucleus_size(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None) -> torch.Tensor:
    """How many tokens the settings keep: [V] → scalar tensor, [B, V] → [B]."""
    return kept_mask(logits, temperature, top_k, top_p).sum(dim=-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw token ids: [V] → scalar tensor, [B, V] → [B].

    temperature 0 is argmax and uses no randomness. Otherwise each row draws from `probabilities(...)`;
    pass a seeded torch.Generator to repeat the same draws (on the same machine and library versions).
    """
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    flat = probs.reshape(-1, probs.shape[-1])  # [B, V]
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [B]
    return ids.reshape(probs.shape[:-1])


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of a distribution (0 for a one-hot, log2(n) for uniform over n)."""
    p = probs.clamp_min(0)
    return -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(-1) + 0.0  # + 0.0 turns -0.0 into 0.0
