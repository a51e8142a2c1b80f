"""Serving many requests: static batching vs continuous (iteration-level) batching over one KV cache.

A server holds at most `max_batch` running requests (its slots). Every iteration it

    1. admits waiting requests that have arrived into free slots            (continuous: every iteration;
                                                                              static: only when the whole
                                                                              batch has finished)
    2. runs ONE forward pass for the admitted requests' prompts and every   (decode_one_token; prompts of
       running request's next token: the weights are read once for all       different lengths are packed
       of them (Orca's "selective batching")                                 in one row, Positions.pack)
    3. retires requests that reached their token limit or EOS, freeing their slot and cache blocks

Static batching is what a plain `generate` over a padded batch does: slots of requests that finished early
stay empty until the longest request ends. Continuous batching (Yu et al., "Orca", OSDI 2022) refills them
at the next iteration. With a PagedKVCache (course.engine.paged) a request holds only the blocks it has
written, requests sharing a system prompt share its full blocks, and when the pool runs dry the newest
request is preempted (its blocks freed, restarted later from its prompt, as vLLM's recompute preemption).

The clock: requests arrive at `arrival` seconds on a serving clock that advances by each iteration's
measured duration (clock="wall") or by 1 per iteration (clock="steps", deterministic, for tests). An idle
server jumps to the next arrival. Decoding is greedy, so every request's tokens equal its solo run.

serve() checks every request before the first iteration, and refuses, naming the request, one that could never
finish: a field of the wrong kind, a token outside the vocabulary, more positions than the model's context or than
the cache it is given can ever hold. A server that cannot make progress raises instead of waiting forever.
"""
from __future__ import annotations

import math
import numbers
import operator
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from course.engine.config import whole
from course.engine.device import synchronize
from course.engine.generate import decode_one_token, generate
from course.engine.kv_cache import KVCache
from course.engine.paged import PagedBatch, PagedKVCache, PoolExhausted

POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class Request:
    """One request: its prompt's token ids, how many tokens it may generate, when it arrives (seconds or steps)."""
    id: Hashable
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival: float = 0.0

    def __post_init__(self):
        try:
            hash(self.id)
            object.__setattr__(self, "prompt_ids", tuple(operator.index(t) for t in self.prompt_ids))
        except TypeError as exc:
            raise ValueError(f"request {self.id!r}: the id must be hashable (an int or a str) and prompt_ids a "
                             f"sequence of whole-number token ids ({exc})") from None
        if not self.prompt_ids:
            raise ValueError(f"request {self.id!r}: the prompt is empty; give at least one token")
        whole(f"request {self.id!r}: max_new_tokens", self.max_new_tokens)
        if isinstance(self.arrival, bool) or not isinstance(self.arrival, numbers.Real) \
                or not math.isfinite(self.arrival) or self.arrival < 0:
            raise ValueError(f"request {self.id!r}: arrival must be a finite number >= 0 (seconds, or steps with "
                             f"clock='steps'), got {self.arrival!r}")

    @property
    def max_len(self) -> int:
        """Positions the request can occupy: prompt + max_new_tokens."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass
class Completion:
    """What the server did for one request. Times are on the serving clock."""
    request: Request
    tokens: list[int] = field(default_factory=list)
    admitted: float = math.nan  # last admission (after a preemption, the re-admission)
    first_token: float = math.nan
    finished: float = math.nan
    cached_tokens: int = 0  # prompt tokens whose K/V came from shared blocks (last admission)
    preemptions: int = 0
    stop_reason: str = ""

    @property
    def time_to_first_token(self):
        return self.first_token - self.request.arrival

    @property
    def latency(self):
        """Arrival to last token."""
        return self.finished - self.request.arrival


@dataclass
class StepRecord:
    """One iteration: when it started, how long it took, and what each slot did ("prefill", "decode", "idle")."""
    start: float
    seconds: float
    slots: list[tuple[int | None, str]]  # per slot: (request id or None, what it did)
    decoded: int  # sequences in the batched decode step
    prefill_tokens: int  # prompt tokens prefilled this iteration
    bytes_reserved: int  # KV bytes the cache held for requests after the step
    bytes_used: int  # KV bytes of positions actually written (shared blocks counted once)
    bytes_logical: int  # KV bytes the requests would hold without sharing
    cpu_seconds: float = math.nan  # this process's CPU time for the iteration (time.process_time)


@dataclass
class ServeResult:
    policy: str
    max_batch: int
    completions: list[Completion]
    timeline: list[StepRecord]
    cache_bytes: int  # bytes of the whole cache (pool or preallocated buffers)

    @property
    def generated_tokens(self):
        return sum(len(c.tokens) for c in self.completions)

    @property
    def makespan(self):
        """First arrival to last finish, on the serving clock."""
        return max(c.finished for c in self.completions) - min(c.request.arrival for c in self.completions)

    @property
    def throughput(self):
        """Generated tokens per second (per step with clock="steps")."""
        return self.generated_tokens / self.makespan

    @property
    def cpu_throughput(self) -> float:
        """Generated tokens per second of this process's CPU time (idle waits for arrivals not counted).

        On a CPU shared with other programs, wall time includes the slices the scheduler gave them; CPU time
        counts only the work this server did, so two policies compare fairly even while the load changes.
        Meaningless for a GPU run (the device's time is not CPU time)."""
        return self.generated_tokens / sum(s.cpu_seconds for s in self.timeline)

    @property
    def ttft_p50(self):
        return percentile([c.time_to_first_token for c in self.completions], 50)

    @property
    def ttft_p95(self):
        return percentile([c.time_to_first_token for c in self.completions], 95)

    @property
    def latency_p50(self):
        return percentile([c.latency for c in self.completions], 50)

    @property
    def latency_p95(self):
        return percentile([c.latency for c in self.completions], 95)

    @property
    def peak_bytes_reserved(self):
        return max((s.bytes_reserved for s in self.timeline), default=0)

    @property
    def peak_bytes_used(self):
        return max((s.bytes_used for s in self.timeline), default=0)

    @property
    def peak_bytes_shared(self):
        return max((s.bytes_logical - s.bytes_used for s in self.timeline), default=0)

    @property
    def slot_occupancy(self) -> float:
        """Share of slot-iterations that did work (prefill or decode) rather than sit idle."""
        cells = [phase for s in self.timeline for _, phase in s.slots]
        return sum(p != "idle" for p in cells) / len(cells) if cells else math.nan

    @property
    def preemptions(self):
        return sum(c.preemptions for c in self.completions)

    def outputs(self) -> dict[int, list[int]]:
        return {c.request.id: list(c.tokens) for c in self.completions}

    def summary(self) -> dict:
        names = ("max_batch", "generated_tokens", "makespan", "throughput", "cpu_throughput", "ttft_p50", "ttft_p95",
                 "latency_p50", "latency_p95", "slot_occupancy", "preemptions", "cache_bytes", "peak_bytes_reserved",
                 "peak_bytes_used", "peak_bytes_shared")
        return {"policy": self.policy, "requests": len(self.completions),
                "iterations": len(self.timeline), **{name: getattr(self, name) for name in names}}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); nan for no values."""
    return float(np.percentile(values, q)) if len(values) else math.nan


# ---------------------------------------------------------------------------------------------- traces
def make_trace(n_requests: int = 16, seed: int = 0, prompt_len: tuple[int, int] = (8, 48),
               new_tokens: tuple[int, int] = (4, 48), mean_gap: float = 0.0, vocab_size: int = 256,
               shared_prefix: Sequence[int] | None = None, low_token: int = 0, long_share: float = 0.0,
               long_new_tokens: tuple[int, int] | None = None) -> list[Request]:
    """A seeded trace: prompt and answer lengths uniform in the given ranges (inclusive), arrivals a Poisson
    process with `mean_gap` between requests (0: all at once). Prompt tokens are random ids in
    [low_token, vocab_size); `shared_prefix` (e.g. a system prompt's ids) opens every prompt.

    long_share > 0 makes answer lengths bimodal, chat traffic's shape: that share of the requests draws from
    long_new_tokens, the rest from new_tokens (the case where a static batch waits for its longest member)."""
    whole("n_requests", n_requests)
    ranges = [("prompt_len", prompt_len), ("new_tokens", new_tokens)]
    if long_share:
        if not 0 < long_share <= 1 or long_new_tokens is None:
            raise ValueError(f"long_share must be in [0, 1] and needs long_new_tokens, got {long_share}, "
                             f"{long_new_tokens}")
        ranges.append(("long_new_tokens", long_new_tokens))
    for name, (lo, hi) in ranges:
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
    if mean_gap < 0:
        raise ValueError(f"mean_gap must be >= 0 seconds, got {mean_gap}")
    rng = random.Random(seed)
    prefix = [int(t) for t in shared_prefix or ()]
    requests, t = [], 0.0
    for i in range(n_requests):
        body = [rng.randrange(low_token, vocab_size) for _ in range(rng.randint(*prompt_len))]
        answer = long_new_tokens if long_share and rng.random() < long_share else new_tokens
        requests.append(Request(i, tuple(prefix + body), rng.randint(*answer), round(t, 6)))
        if mean_gap:
            t += rng.expovariate(1.0 / mean_gap)
    return requests


# ---------------------------------------------------------------------------------------------- the server
@dataclass(eq=False)
class _Running:
    completion: Completion
    slot: int
    last: int | None = None  # the token it produced last
    feed: list[int] = field(default_factory=list)  # the tokens this iteration runs for it (its prompt, or its last)
    start: int = 0  # the position of feed[0]


def _checked(model, requests, policy, max_batch, cache, block_size, num_blocks, clock, eos_id) -> list[Request]:
    """serve()'s arguments, checked before the first iteration (the module docstring says what is refused)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if clock not in ("wall", "steps"):
        raise ValueError(f"clock must be 'wall' or 'steps', got {clock!r}")
    whole("max_batch", max_batch), whole("block_size", block_size)
    if num_blocks is not None:
        whole("num_blocks", num_blocks)
    if eos_id is not None:
        whole("eos_id", eos_id, minimum=0)
    requests = list(requests)
    if not requests:
        raise ValueError("no requests to serve")
    odd = next((r for r in requests if not isinstance(r, Request)), None)
    if odd is not None:
        raise ValueError(f"requests must be Request objects (Request(id, prompt_ids, max_new_tokens, arrival)); got "
                         f"a {type(odd).__name__}: {odd!r:.80}")
    if len({r.id for r in requests}) != len(requests):
        raise ValueError("request ids must be unique; two requests share an id")
    config = model.config
    for r in requests:
        if max(r.prompt_ids) >= config.vocab_size or min(r.prompt_ids) < 0:
            raise ValueError(f"request {r.id!r} holds token ids outside the model's vocabulary of {config.vocab_size}; "
                             f"make the trace with vocab_size={config.vocab_size}")
        if r.max_len > config.max_seq_len:
            raise ValueError(f"request {r.id!r} needs {r.max_len} positions, beyond the model's context of "
                             f"{config.max_seq_len}; shorten its prompt or max_new_tokens")
    free, bs = (num_blocks, block_size) if cache == "paged" else (None, None)
    if isinstance(cache, PagedKVCache):
        c = cache.config
        if (c.n_layers, c.n_kv_heads, c.head_dim) != (config.n_layers, config.n_kv_heads, config.head_dim):
            raise ValueError(f"the PagedKVCache was made for {c.name} (L={c.n_layers}, H_kv={c.n_kv_heads}, "
                             f"D_h={c.head_dim}), not for this model's shapes; create it with the model's config")
        taken = [r.id for r in requests if r.id in cache.sequences]
        if taken:
            raise ValueError(f"requests {taken} are already sequences in the given cache; free them or use other ids")
        free, bs = cache.allocator.num_free, cache.block_size
    elif cache != "paged":
        raise ValueError(f"cache must be 'paged' or a PagedKVCache, got {cache!r:.80}")
    for r in requests if free else ():
        if -(-r.max_len // bs) > free:
            raise ValueError(f"request {r.id!r} needs {-(-r.max_len // bs)} blocks of {bs} tokens, more than the whole "
                             f"pool's {free} free blocks, so it could never finish; create the cache with more blocks")
    return sorted(requests, key=lambda r: r.arrival)  # stable: requests arriving together keep their order


@torch.inference_mode()
def serve(model, requests: Sequence[Request], policy: str = "continuous", max_batch: int = 8, *,
          cache: PagedKVCache | str = "paged", block_size: int = 16, num_blocks: int | None = None,
          share_prefix: bool = True, eos_id: int | None = None, clock: str = "wall",
          progress: bool = True) -> ServeResult:
    """Run every request through the model with one scheduling policy; greedy decoding.

    cache: "paged" (a PagedKVCache of num_blocks, default enough for every request at its longest), or a
    PagedKVCache (it keeps the full blocks it has cached between calls: a second run over it starts with a warm
    prefix cache).
    ValueError, naming the request, for anything that could never be served (see the module's docstring).
    """
    requests = _checked(model, requests, policy, max_batch, cache, block_size, num_blocks, clock, eos_id)
    device, paged = model.device, cache
    if cache == "paged":
        blocks = num_blocks or sum(-(-r.max_len // block_size) for r in requests)
        paged = PagedKVCache(model.config, blocks, block_size, model.dtype, device)

    completions = {r.id: Completion(r) for r in requests}
    pending = deque(requests)  # not arrived yet
    waiting: deque[Request] = deque()  # arrived, not admitted
    running: list[_Running] = []
    free_slots = list(range(max_batch))
    timeline: list[StepRecord] = []
    now = 0.0
    bar = tqdm(total=len(requests), desc=f"{policy} batching", unit="req", disable=not progress)

    def sync_now(t0: float) -> float:
        if clock == "steps":
            return now + 1.0  # a token exists at the end of its iteration
        synchronize(device)
        return now + time.perf_counter() - t0

    def release(r: _Running) -> None:
        paged.free_sequence(r.completion.request.id)
        free_slots.append(r.slot)
        free_slots.sort()
        running.remove(r)

    def admit(req: Request) -> _Running | None:
        """Give a waiting request the first free slot and reserve its prompt's positions (None: no room)."""
        prompt = list(req.prompt_ids)
        # admit when the prompt fits with one block to spare per running request (their next decode step)
        if -(-len(prompt) // paged.block_size) + len(running) > paged.allocator.num_free:
            return None
        cached = paged.add_sequence(req.id, prompt, share=share_prefix)  # shared full blocks of its prefix
        try:
            paged.reserve([req.id], [prompt[cached:]])
        except PoolExhausted:
            paged.free_sequence(req.id)
            return None
        r = _Running(completions[req.id], free_slots.pop(0))
        r.completion.admitted, r.completion.cached_tokens = now, cached
        r.feed, r.start = prompt[cached:], cached
        running.append(r)
        return r

    while pending or waiting or running:
        while pending and pending[0].arrival <= now:
            waiting.append(pending.popleft())
        if not waiting and not running:
            now = pending[0].arrival  # idle until the next request arrives
            continue
        t0, cpu0 = time.perf_counter(), time.process_time()
        phase: dict[int, tuple[int, str]] = {}
        admitted: list[_Running] = []
        if policy == "continuous" or not running:
            while waiting and free_slots and (r := admit(waiting[0])) is not None:
                waiting.popleft()
                admitted.append(r)
                phase[r.slot] = (r.completion.request.id, "prefill")
        if not running:  # nothing runs and the first in line cannot be admitted: waiting would never end
            raise RuntimeError(f"request {waiting[0].id!r} cannot be admitted into an idle server: its prompt needs "
                               "more KV blocks than the pool has free; create the cache with more blocks")
        decoding = [r for r in running if r not in admitted and not r.completion.stop_reason]
        decoding = _reserve_decoders(decoding, paged, waiting, release)
        for r in decoding:
            phase[r.slot] = (r.completion.request.id, "decode")
        step = admitted + decoding
        if step:
            _step(model, step, paged, device)
            t_tok = sync_now(t0)
            for r in step:
                _emit(r, t_tok, eos_id)
        elapsed = 1.0 if clock == "steps" else sync_now(t0) - now
        for r in list(running):
            if r.completion.stop_reason:
                release(r)
                bar.update(1)
        slots = [(phase[s] if s in phase else (None, "idle")) for s in range(max_batch)]
        mem = (paged.bytes_reserved, paged.bytes_used, paged.bytes_logical)
        prefill_tokens = sum(len(r.completion.request.prompt_ids) - r.completion.cached_tokens for r in admitted)
        timeline.append(StepRecord(now, elapsed, slots, len(decoding), prefill_tokens, *mem,
                                   cpu_seconds=time.process_time() - cpu0))
        now += elapsed
    bar.close()
    return ServeResult(policy, max_batch, [completions[r.id] for r in requests], timeline, paged.nbytes)


def _emit(r: _Running, t: float, eos_id: int | None) -> None:
    c = r.completion
    c.tokens.append(r.last)
    if len(c.tokens) == 1:
        c.first_token = t
    if eos_id is not None and r.last == eos_id:
        c.stop_reason = "eos"
    elif len(c.tokens) >= c.request.max_new_tokens:
        c.stop_reason = "length"
    if c.stop_reason:
        c.finished = t


def _reserve_decoders(decoding: list[_Running], paged: PagedKVCache, waiting: deque,
                      release) -> list[_Running]:
    """Each running request's next position (its last token goes there); preempts the newest if the pool is full."""
    for r in decoding:
        r.feed = [r.last]
        r.start = len(r.completion.request.prompt_ids) + len(r.completion.tokens) - 1
    while decoding:
        try:
            paged.reserve([r.completion.request.id for r in decoding], [r.feed for r in decoding])
            break
        except PoolExhausted:
            if len(decoding) == 1:
                raise
            victim = max(decoding, key=lambda r: r.completion.admitted)  # the newest (the last of equals)
            decoding.remove(victim)
            release(victim)  # recompute preemption: its blocks and slot go back; it starts again later
            c = victim.completion
            c.tokens.clear()
            c.first_token, c.preemptions = math.nan, c.preemptions + 1
            waiting.appendleft(c.request)
    return decoding


def _step(model, step: list[_Running], paged: PagedKVCache, device) -> None:
    """ONE forward pass for the iteration's new prompts and next tokens: a [B, 1] batch when each feeds one token,
    else every feed packed in one row [1, N] (Positions.pack, the module docstring's step 2)."""
    counts = [len(r.feed) for r in step]
    uniform = len(set(counts)) == 1
    batch = PagedBatch(paged, [r.completion.request.id for r in step], [r.start for r in step],
                       counts[0] if uniform else counts)
    feeds = [r.feed for r in step] if uniform else [[t for r in step for t in r.feed]]
    tokens = torch.tensor(feeds, dtype=torch.long, device=device)  # [B, T] or packed [1, N]
    logits = decode_one_token(model, tokens, batch.positions, batch)  # [B, V]: the engine's one step, B at once
    for r, token in zip(step, logits.argmax(-1).tolist()):
        r.last = int(token)


# ---------------------------------------------------------------------------------------------- checks
def solo_outputs(model, requests: Sequence[Request], eos_id: int | None = None,
                 progress: bool = True) -> dict[int, list[int]]:
    """Each request run alone through generate() (greedy): what serve() must reproduce."""
    return {r.id: generate(model, list(r.prompt_ids), r.max_new_tokens, eos_id=eos_id).tokens
            for r in tqdm(requests, desc="solo runs", unit="req", disable=not progress)}


def memory_on_mix(config, requests: Sequence[Request], block_size: int = 16, max_seq_len: int | None = None,
                  dtype: torch.dtype = torch.float32) -> dict:
    """KV bytes for every request of the mix resident at its full length (prompt + max_new_tokens):

    used          Σ lengths · bytes_per_token            what the requests actually hold
    paged         blocks the allocator hands out · block bytes   (measured with a PagedKVCache's allocator)
    preallocated  one max_seq_len slot per request (default: the mix's longest request), as a KVCache
    """
    max_seq_len = max_seq_len or max(r.max_len for r in requests)
    blocks = sum(-(-r.max_len // block_size) for r in requests)
    cache = PagedKVCache(config, blocks, block_size, dtype, device="meta")
    for r in requests:
        cache.add_sequence(r.id)
        cache.reserve([r.id], n_new=r.max_len)
    pre = KVCache(config, batch=len(requests), max_seq_len=max_seq_len, dtype=dtype, device="meta").nbytes
    used = sum(r.max_len for r in requests) * cache.bytes_per_token
    return {"used": used, "paged": cache.bytes_reserved, "preallocated": pre,
            "paged_over_used": cache.bytes_reserved / used, "preallocated_over_used": pre / used,
            "block_size": block_size, "max_seq_len": max_seq_len}
