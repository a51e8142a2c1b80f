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


def _check_logits(logits: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Shape and type (free), then one reduction and one device sync: every row's largest logit must be finite.

    The row maxima catch all three faults at once (a NaN anywhere makes its row's max NaN, a +inf makes it +inf,
    a row of only -inf has max -inf); the slower diagnosis below runs only when something is wrong. `dtype`: the
    dtype the model computed in (the logits may have been upcast since), for the message.
    """
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor of shape [V] or [B, V], got {type(logits).__name__}")
    if logits.dim() not in (1, 2) or logits.shape[-1] == 0 or logits.numel() == 0:
        raise ValueError(f"logits must have shape [V] or [B, V] with V >= 1 and B >= 1, got {tuple(logits.shape)}; "
                         "for a model's [B, T, V] output take the last position: logits[:, -1]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}; convert with logits.float()")
    if bool(torch.isfinite(logits.amax(dim=-1)).all()):  # the one reduction over V, the one sync
        return
    dtype = dtype or logits.dtype
    name = str(dtype).replace("torch.", "")
    why = ("float16 overflowed (its largest value is 65504): run the model in bfloat16 or float32"
           if dtype == torch.float16 else "check the model's weights and inputs")
    if torch.isnan(logits).any():
        raise ValueError(f"logits contain NaN (the model computed in {name}); {why}")
    if torch.isposinf(logits).any():
        raise ValueError(f"logits contain +inf (the model computed in {name}); they must be finite or -inf "
                         f"(-inf = a token that is ruled out); {why}")
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
    return _scale(logits, temperature)


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T; in a row where a tiny T overflows float32, the gaps to the row's max / T instead (softmax
    ignores a constant shift). Chosen per row on the device: no sync."""
    scaled = logits / temperature
    gaps = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return torch.where(torch.isposinf(scaled).any(dim=-1, keepdim=True), gaps, scaled)


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
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [..., V]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)  # mass ranked above
    n_keep = (mass_before < p).sum(dim=-1, keepdim=True).clamp_min(1)  # [..., 1] the nucleus size
    threshold = sorted_logits.gather(-1, n_keep - 1)  # [..., 1] the smallest logit the nucleus needs
    return logits.masked_fill(logits < threshold, float("-inf"))


def _transform(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on logits and settings already checked."""
    logits = logits.float()
    return top_p_filter(top_k_filter(_scale(logits, temperature) if temperature > 0 else logits, top_k), top_p)


def transform_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p: the composition transformers' generate() uses.

    temperature 0 leaves the logits unscaled here (greedy has no distribution to reshape).
    """
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    return _transform(logits, temperature, top_k, top_p)


def probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """The distribution the sampler draws from (renormalised over the kept tokens). Same shape as logits.

    temperature 0 gives a one-hot on the argmax (the lowest id if the largest logits tie).
    """
    return Sampler(temperature, top_k, top_p).probs(logits)


def kept_mask(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
              top_p: float | None = None) -> torch.Tensor:
    """Boolean mask of the tokens the settings keep: the argmax alone at temperature 0, else every token
    top-k and top-p leave a finite logit (a kept token far below the top may still round to probability 0)."""
    _check_logits(logits)
    check_params(temperature, top_k, top_p)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).bool()
    return torch.isfinite(_transform(logits, temperature, top_k, top_p))


def nucleus_size(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None) -> torch.Tensor:
    """How many tokens the settings keep: [V] → scalar tensor, [B, V] → [B]."""
    return kept_mask(logits, temperature, top_k, top_p).sum(dim=-1)


class Sampler:
    """The sampler's settings, checked once; then one call per decode step.

        pick = Sampler(temperature=0.7, top_p=0.9, seed=0)
        ids, probs = pick(logits)    # logits [B, V] (or [V]) → token ids [B] and the distribution [B, V]
                                     # they were drawn from (one-hot when greedy), as gpt-fast's sample()

    Each call checks the logits (_check_logits: one reduction, one sync), never the settings again. `dtype`: the
    dtype the model computes in, named if its logits go bad.
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None, *, seed: int | None = None, device=None,
                 dtype: torch.dtype | None = None):
        check_params(temperature, top_k, top_p)
        if generator is None and seed is not None:
            generator = torch.Generator(device=device or "cpu").manual_seed(seed)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator, self.dtype = generator, dtype

    @property
    def greedy(self):
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a call would draw from (same shape as logits)."""
        _check_logits(logits, self.dtype)
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return _transform(logits, self.temperature, self.top_k, self.top_p).softmax(dim=-1)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.probs(logits)
        if self.greedy:
            return logits.argmax(dim=-1), probs
        flat = probs.reshape(-1, probs.shape[-1])  # [B, V]
        ids = torch.multinomial(flat, 1, generator=self.generator).squeeze(-1)  # [B]
        return ids.reshape(probs.shape[:-1]), probs


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw token ids: [V] → scalar tensor, [B, V] → [B].

    temperature 0 is argmax and uses no randomness. Otherwise each row draws from `probabilities(...)`;
    pass a seeded torch.Generator to repeat the same draws (on the same machine and library versions).
    A Sampler also returns the distribution, as speculative decoding needs.
    """
    return Sampler(temperature, top_k, top_p, generator)(logits)[0]


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of a distribution (0 for a one-hot, log2(n) for uniform over n)."""
    p = probs.clamp_min(0)
    return -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(-1) + 0.0  # + 0.0 turns -0.0 into 0.0
