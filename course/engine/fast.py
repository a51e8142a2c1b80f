"""The compiled decode step: torch.compile over the model's own blocks, one new token per sequence.

    step = DecodeStep(model)                    # compiles on the first call of B = 1, and of any B >= 2
    logits = step(tokens, positions, cache)     # tokens [B, 1], positions [B] (or one int), a KVCache → [B, V]
    fast = FastModel(model)                     # the model's call signature: generate(fast, ids, 64)
    server = FastModel(model, any_shape=True)   # every batch, context and paged batch (lesson 05's serve)

The graph is gpt-fast's decode step (github.com/pytorch-labs/gpt-fast, generate.py): the embedding, the model's
own TransformerBlocks (its modules, its weights, no copy), the final norm and the head, each layer writing this
step's K and V in place into the preallocated cache and attending over the whole buffer under a mask that hides
the positions a sequence has not reached. Every shape is fixed (the buffer's length, not the context) and the
positions are a tensor, so decoding further never recompiles. Prefill is a matrix-matrix product BLAS does
well: it stays eager. On CUDA the step is captured as a CUDA graph (mode="reduce-overhead", gpt-fast's choice).

Four pieces make it faster than torch.compile of the model alone, each kept because it bought at least 5 % on a
figure the course shows (decode ÷ its bandwidth floor at B = 1, the batch sweep):
    one row     inside the graph, F.linear of one row is written (x · W).sum(-1), which Inductor turns into one loop
                streaming each weight row once, fused with the norm before it; BLAS's matrix-vector product reads
                the weights well below the memory's speed (_Products, a TorchFunctionMode: nothing else changes)
    2+ rows     F.linear of a batch calls course.engine.row_product's C++ kernel (float32 CPU): each weight row read
                once for the whole batch, where BLAS's matrix-matrix kernels took 1.7-3.4× the one-row time at B = 2 … 16
                (with AVX2 it hands more than 16 rows to BLAS, which wins there; with AVX-512 it keeps them)
    attention   on the CPU one query's attention is written as sums Inductor fuses, not ATen's flash-attention kernel
                (B = 8: 0.91× the time; 17d83f0's C++ kernel would take 2-3 % more off: docs/benchmarks.md)
    arena       on the CPU the model's weights move onto huge pages first (course.engine.arena.pack_parameters)

Each variant's step ÷ the shipped one (docs/benchmarks.md, AVX-512, 1 thread), B = 1 / 8: torch.compile of the
forward 2.37 / 2.51, + one row and the kernel 1.42 / 1.17, + attention 1.36 / 1.14, + arena 1.00. Not kept (under
5 % each): Inductor's C++ wrapper, skipping TorchDynamo's guards once warm.

any_shape=True compiles one TransformerBlock (and the head) instead of the whole step, for every batch size, cache
length, set of cache rows and paged batch at once (their sizes symbolic): a server's batches change at every step,
and one block compiles in seconds where a whole step takes a minute. The graphs are shared by every model (the
bytes line times models of several published shapes with them); the price is a call through TorchDynamo per block.
"""
from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode

from course.engine import row_product
from course.engine.arena import pack_parameters
from course.engine.kv_cache import KVCache
from course.engine.paged import PagedBatch, gather_blocks, write_slots
from course.engine.positions import Positions


class _Products(TorchFunctionMode):
    """Inside a compiled step: F.linear of one row streamed, of a batch on the row kernel, one query's attention as
    sums (see the module doc). Outside torch.compile it changes nothing (an eager fallback is the model itself)."""

    def __init__(self, stream: bool, kernel: bool, attend: bool = False):
        super().__init__()
        self.stream, self.kernel, self.attend = stream, kernel, attend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not torch.compiler.is_compiling():
            return func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention and self.attend:
            q, k, v = args[:3]  # q [B, H, 1, D_h]; k, v [B, H_kv, S, D_h]; the mask [B, 1, 1, S]
            if statically_known_true(q.shape[2] == 1) and kwargs.get("attn_mask") is not None:
                B, H, _, D = q.shape
                q = q.view(B, k.shape[1], 1, H // k.shape[1], D).transpose(2, 3)  # [B, H_kv, G, 1, D_h]
                scores = (q * k[:, :, None]).sum(-1) * D ** -0.5  # [B, H_kv, G, S]
                weights = scores.masked_fill(~kwargs["attn_mask"], float("-inf")).softmax(-1)
                return (weights[..., None] * v[:, :, None]).sum(-2).view(B, H, 1, D)
        if func is F.linear and args[2:3] in ((), (None,)):
            x, w = args[0], args[1]
            if self.stream and statically_known_true(x.shape[:-1].numel() == 1):  # [.., 1, d] · [N, d] → [.., 1, N]
                return (x.unsqueeze(-2) * w).sum(-1, dtype=torch.float32).to(x.dtype)
            if self.kernel:
                return torch.ops.kvcourse.row_product(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
        return func(*args, **(kwargs or {}))


class StepPositions:
    """The positions the model's blocks read (course.engine.positions.Positions' `mask`, `causal`, `cache_pos`) as
    tensors only: inside a graph a Python list of positions would be a constant, and each new position a new graph.
    positions [B, 1]; mask [B, 1, 1, S]: key j visible to sequence b iff j <= positions[b]."""
    causal = False

    def __init__(self, positions: torch.Tensor, keys: int):
        self.positions = positions[:, None]  # [B, 1]
        self.mask = (torch.arange(keys, device=positions.device) <= self.positions)[:, None, None, :]

    @property
    def cache_pos(self):
        return self  # what the model's attention hands its cache: _CacheLayer.update reads .positions


class _CacheLayer:
    """One layer's cache as the compiled step writes and reads it: the whole buffers, so no shape depends on the
    context. Contiguous: k, v [B_cache, H_kv, S, D_h], rows [B] (gather: rows is not every row of the buffer).
    Paged: k, v are the layer's pools [N_blocks, block_size, H_kv, D_h], rows the slots written, table [B, n]."""

    def __init__(self, k, v, rows, gather: bool, table=None):
        self.k, self.v, self.rows, self.gather, self.table = k, v, rows, gather, table

    @property
    def keys(self) -> int:
        """The key positions attention reads per sequence: the buffer's length, or the blocks' in the table."""
        return self.k.shape[2] if self.table is None else self.table.shape[1] * self.k.shape[1]

    def update(self, at: StepPositions, k: torch.Tensor, v: torch.Tensor):
        if self.table is not None:
            write_slots(self.k, self.rows, k[:, :, 0])  # [B, H_kv, D_h] at each sequence's slot
            write_slots(self.v, self.rows, v[:, :, 0])
            return gather_blocks(self.k, self.table), gather_blocks(self.v, self.table)  # [B, H_kv, S, D_h]
        self.k[self.rows, :, at.positions[:, 0]] = k[:, :, 0]  # sequence b: row rows[b], position positions[b]
        self.v[self.rows, :, at.positions[:, 0]] = v[:, :, 0]
        if self.gather:
            return self.k[self.rows], self.v[self.rows]  # [B, H_kv, S, D_h], a copy
        return self.k, self.v


def _start(model, tokens, positions):
    """What every block of a step shares: the embedded tokens x [B, 1, d] and RoPE's angles [B, 1, 1, D_h]."""
    cos = model.rope_cos[positions][:, None, None].to(model.dtype)
    sin = model.rope_sin[positions][:, None, None].to(model.dtype)
    return model.tok_embeddings(tokens[:, :1]), cos, sin


def _head(model, x, hooks: tuple):
    with _Products(*hooks):
        return model.output(model.norm(x[:, -1])).float()  # [B, V]


def _block(layer, x, cos, sin, positions, layer_cache, hooks: tuple, at=None):
    with _Products(*hooks):
        return layer(x, cos, sin, at or StepPositions(positions, layer_cache.keys), layer_cache)


def _step(model, tokens, positions, ks, vs, rows, gather: bool, table, hooks: tuple):
    """One decode step: tokens [B, 1] at positions [B] → next-token logits [B, V]; writes the cache in place."""
    x, cos, sin = _start(model, tokens, positions)
    caches = [_CacheLayer(k, v, rows, gather, table) for k, v in zip(ks, vs)]
    at = StepPositions(positions, caches[0].keys)  # built once, read by every block
    for layer, cache in zip(model.layers, caches):
        x = _block(layer, x, cos, sin, positions, cache, hooks, at)
    return _head(model, x, hooks)


def _own_code(fn):
    """fn with a code object of its own: TorchDynamo keeps its graphs, and counts recompilations towards its limit
    (8), per code object, so every DecodeStep compiling the same function would share one cache and one count."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# any_shape: one compiled block and head for every model (their sizes symbolic); enough room for every kind of call
_SHARED = {}
SHARED_RECOMPILE_LIMIT = 64


class DecodeStep:
    """`step(tokens [B, 1], positions, cache) → logits [B, V]`: the decode step, compiled (see the module doc).

    positions: one int for every sequence, a list of B ints or a [B] tensor. cache: a contiguous KVCache (rows: the
    cache row of each sequence; None: rows 0..B-1, the whole cache) or a paged batch (course.engine.paged.PagedBatch,
    one new token per sequence, which brings its own positions). The first call of a shape compiles (tens of
    seconds on 2 CPU cores; Inductor keeps the result on disk, so a later process starts in seconds): one graph for
    B = 1 and one for every B >= 2, per cache length, dtype and device. compile=False runs the same function eagerly.

    If compiling fails (no C++ compiler, TorchDynamo's recompile limit, TorchDynamo turned off) the step warns once
    and runs eagerly from then on: `compiled` turns False and `fallback` says why. Never fail a lesson for speed;
    never report the eager step as the compiled one (the bench refuses such a row).
    """

    def __init__(self, model: nn.Module, compile: bool = True, mode: str | None = None, any_shape: bool = False,
                 stream: bool = True, kernel: bool | None = None):
        self.model, self.any_shape, self.compiled, self.fallback = model, any_shape, compile, None
        if compile and model.device.type == "cpu":
            pack_parameters(model)  # the weights on huge pages (course.engine.arena), where Linux offers them
        cpu32 = model.device.type == "cpu" and model.dtype == torch.float32
        self.kernel = bool(compile and cpu32 and row_product.available()) if kernel is None else kernel
        self.hooks = (stream, self.kernel, compile and model.device.type == "cpu")  # _Products' (stream, kernel,
        # attend); all False: the model's blocks alone
        self.mode = mode or ("reduce-overhead" if model.device.type == "cuda" and not any_shape else None)
        if any_shape:
            if compile and not _SHARED:
                _SHARED.update(block=torch.compile(_block, dynamic=None, fullgraph=True),
                               head=torch.compile(_head, dynamic=None, fullgraph=True))
            self._code = [_block.__code__, _head.__code__]
        else:
            fn = _own_code(_step)
            self._compiled = torch.compile(fn, mode=self.mode, fullgraph=True) if compile else None
            self._code = [fn.__code__]
        self._seen: set = set()

    @property
    def config(self):
        return self.model.config

    def __repr__(self) -> str:
        return f"DecodeStep({self.config.name}, compiled={self.compiled}, any_shape={self.any_shape})"

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions, cache, rows=None) -> torch.Tensor:
        B = tokens.shape[0]
        if tokens.dim() != 2 or tokens.shape[1] != 1:
            raise ValueError(f"tokens must be [B, 1] (one new token per sequence), got {list(tokens.shape)}")
        if isinstance(cache, PagedBatch):
            if cache.packed or cache.n_new != 1 or len(cache.seq_ids) != B:
                raise ValueError(f"the compiled step decodes one new token for each of the batch's sequences; this "
                                 f"paged batch holds {len(cache.seq_ids)} sequences × {cache.n_new} tokens")
            cache.check_call(positions, 1)
            ks, vs, table = cache.cache.k, cache.cache.v, cache.block_table
            positions, rows, gather, S = cache.positions.start, cache.write_slots, False, 0
        else:
            ks, vs, rows, gather, table = *self._buffers(cache, B, rows), None
            S = ks[0].shape[2]
        if self.any_shape:  # the compiler's marks of symbolic sizes go on views, not on the cache's own tensors
            ks, vs = [k[:] for k in ks], [v[:] for v in vs]
        args = (tokens.to(torch.long, copy=True), self._positions(positions, B, S, ks[0].device), ks, vs, rows,
                gather, table)  # fresh tensors made here, in inference mode, at every call
        if not self.compiled:
            return _step(self.model, *args, self.hooks)
        first = self._first_call(args)
        try:
            out = self._run(*args, mark=first)
        except Exception as exc:  # compiling failed; wrong inputs raise again here, eagerly, and the step stays
            out = _step(self.model, *args, self.hooks)
            self._fall_back(f"{type(exc).__name__}: {str(exc).strip()[:300]}")
            return out
        if first:
            self._check_compiled()
        return out

    def _run(self, tokens, positions, ks, vs, rows, gather, table, mark: bool):
        if not self.any_shape:
            out = self._compiled(self.model, tokens, positions, ks, vs, rows, gather, table, self.hooks)
            return out.clone() if self.mode == "reduce-overhead" else out  # a CUDA graph reuses its output buffer
        model, block, head = self.model, _SHARED["block"], _SHARED["head"]
        x, cos, sin = _start(model, tokens, positions)
        if mark and x.shape[0] >= 2:  # the batch is symbolic in the traced block and head
            for t in (x, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
        with torch._dynamo.config.patch(recompile_limit=SHARED_RECOMPILE_LIMIT):
            for layer, k, v in zip(model.layers, ks, vs):
                x = block(layer, x, cos, sin, positions, _CacheLayer(k, v, rows, gather, table), self.hooks)
            return head(model, x, self.hooks)

    def _buffers(self, cache: KVCache, B: int, rows):
        """A contiguous cache's K and V buffers (the rows of a batch that are consecutive as views), and rows as a
        tensor (gather: not every row of the buffers)."""
        if type(cache) is not KVCache:
            raise TypeError(f"the compiled step writes a contiguous KVCache or a PagedBatch; got {type(cache).__name__}")
        ks, vs = [layer.k for layer in cache.layers], [layer.v for layer in cache.layers]
        if len(ks) != self.config.n_layers or ks[0].dtype != self.model.dtype or ks[0].device != self.model.device:
            raise TypeError(f"the cache must hold {self.config.n_layers} layers of {self.model.dtype} on "
                            f"{self.model.device}, like the model; got {len(ks)} of {ks[0].dtype} on {ks[0].device}")
        B_cache = ks[0].shape[0]
        rows = list(range(B)) if rows is None else [int(r) for r in rows]
        if len(rows) != B or not 0 <= min(rows) <= max(rows) < B_cache:
            raise ValueError(f"cache rows {rows} for {B} sequences: give one row each, in a cache of {B_cache} rows")
        if rows == list(range(rows[0], rows[0] + B)):  # consecutive rows: views of them, no copy
            first = rows[0]
            if (first, B) != (0, B_cache):
                ks, vs = [k[first:first + B] for k in ks], [v[first:first + B] for v in vs]
            return ks, vs, torch.arange(B, device=ks[0].device), False
        return ks, vs, torch.tensor(rows, device=ks[0].device), True

    def _positions(self, positions, B: int, S: int, device) -> torch.Tensor:
        """positions as a fresh [B] long tensor, each checked to fit the cache (S: its length; 0 for a paged
        batch, whose positions its cache checked)."""
        if isinstance(positions, torch.Tensor) and positions.dim() == 1:
            positions = positions.tolist()
        positions = [int(positions)] * B if not isinstance(positions, (list, tuple)) else [int(p) for p in positions]
        if len(positions) != B:
            raise ValueError(f"{len(positions)} positions for {B} sequences; give one per sequence (or one int)")
        if S and not 0 <= min(positions) <= max(positions) < S:
            raise ValueError(f"KV cache overflow: positions {min(positions)}..{max(positions)} do not fit in a "
                             f"cache of {S} tokens; create the cache with a larger max_seq_len")
        return torch.tensor(positions, dtype=torch.long, device=device)

    def _first_call(self, args) -> bool:
        """Once per kind of call (True the first time): which sizes are symbolic (the batch for B >= 2; every size
        on the any-shape path), and on CUDA graphs the cache buffers' addresses kept (the graph writes them)."""
        tokens, positions, ks, vs, rows, gather, table = args
        B = tokens.shape[0]
        kind = (B == 1, gather, table is None, ks[0].shape, ks[0].dtype, torch.get_num_threads())
        if kind in self._seen:
            return False
        self._seen.add(kind)
        mark = torch._dynamo.mark_dynamic
        if self.any_shape:  # batch (B >= 2), rows or blocks, cache length or blocks per sequence
            for t in (positions, rows, *(() if table is None else (table,))) if B >= 2 else ():
                mark(t, 0)
            for t in ks[:1] + vs[:1]:
                if t.shape[0] >= 2:
                    mark(t, 0)
                if table is None and t.shape[2] >= 2:
                    mark(t, 2)
            if table is not None and table.shape[1] >= 2:
                mark(table, 1)
        elif B >= 2:  # one graph for every batch of 2 or more
            for t in (tokens, positions, rows, *(() if gather else ks + vs)):
                mark(t, 0)
        if self.mode == "reduce-overhead":
            for t in ks + vs:
                torch._dynamo.mark_static_address(t)
        return True

    def _check_compiled(self) -> None:
        """TorchDynamo turned off (TORCHDYNAMO_DISABLE=1) runs every call eagerly without a word: not compiled."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        if not all(_debug_get_cache_entry_list(code) for code in self._code):
            self._fall_back("TorchDynamo compiled no graph for it (is TorchDynamo turned off?)")

    def _fall_back(self, why: str) -> None:
        warnings.warn(f"the compiled decode step fell back to eager ({why}); decoding eagerly instead")
        self.compiled, self.fallback = False, why


class FastModel:
    """A course Transformer with the model's call signature whose decode steps run the compiled DecodeStep.

    A decode step is one token per sequence against a contiguous KVCache (at one position for all, or one per
    sequence: a list, a [B] tensor or a Positions whose rows pick the cache rows) or against a paged batch (one
    token per sequence), so `generate`, `decode_one_token` and the serving scheduler run compiled unchanged.
    Prefill, packed prompts, calls without a cache and other caches go to the eager model.
    """

    def __init__(self, model: nn.Module, compile: bool = True, mode: str | None = None, any_shape: bool = False):
        self.model = model
        self.step = DecodeStep(model, compile=compile, mode=mode, any_shape=any_shape)

    config = property(lambda self: self.model.config)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)
    compiled = property(lambda self: self.step.compiled)

    def __call__(self, tokens: torch.Tensor, start_pos=0, cache=None, last_only: bool = False):
        pos, rows = start_pos, None
        if isinstance(pos, Positions):  # one new token per sequence: its starts (and cache rows); else eager
            one_each = not pos.packed and max(pos.n_new) == 1
            pos, rows = (pos.start if pos.rows or len(pos.start) > 1 else pos.start[0], pos.rows) if one_each else (None, None)
        kind = type(cache)
        if pos is not None and tokens.shape[1] == 1 and (kind is KVCache or (kind is PagedBatch and not cache.packed)):
            logits = self.step(tokens, pos, cache, rows=rows if kind is KVCache else None)  # [B, V]
            return logits if last_only else logits[:, None]
        return self.model(tokens, start_pos=start_pos, cache=cache, last_only=last_only)

    def __repr__(self) -> str:
        return f"FastModel({self.config.name}, compiled={self.compiled})"
