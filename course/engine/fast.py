"""The compiled decode step: one graph per batch size, from the token ids to the logits.

    step = course.engine.fast.DecodeStep(model)        # compiles on the first call of each batch size
    logits = step(tokens, positions, cache)            # tokens [B, 1], positions [B], a KVCache → [B, V]

    fast = course.engine.fast.FastModel(model)         # the model's call signature, for generate() & co.
    generate(fast, ids, 64)                            # prefill runs eagerly, every decode step compiled
    server = course.engine.fast.FastModel(model, any_shape=True)  # compiled groups of layers for every
    serve(server, requests)                            # batch, context and paged batch (course.engine.serving)

What is inside the one graph (the way gpt-fast's generate.py builds its decode step): the embedding
lookup, every layer's RMSNorm, projections, RoPE, the write of this step's K and V into the
*preallocated* cache, attention over the whole cache buffer with a mask that hides the positions a
sequence has not reached, SwiGLU, the final norm and the LM head. Every shape in it is fixed (the cache
buffer's length, not the context), and the positions are a tensor, so decoding further into the same
cache never recompiles. Nothing of a step runs in Python between the layers.

Why it can be faster than the eager model. Decode multiplies one row vector by every weight matrix: a
matrix-vector product (GEMV) that should run at memory speed. Where the BLAS call behind `F.linear`
reaches only a fraction of the memory bandwidth for a single row, the same product written as a
reduction, `(x * W).sum(-1)`, becomes one vectorised Inductor loop that streams each weight row once.
Attention, where the kernel below builds, is one call per layer to its own CPU kernel (kernel_attention).
On a CPU in float32, where course.engine.row_product's kernel builds (a C++ compiler and AVX-512), the step calls
that kernel from inside the graph for batches of 2 or more: each weight row is read once, prefetched ahead of the
arithmetic, and serves every sequence, so a step of 8 costs little more than a step of 1 (one row takes it too,
except on Intel CPUs, where the streamed reduction measured faster: see batch_row_linear). On Intel CPUs batches
above 16 use BLAS's matrix-matrix product instead (course.engine.row_product.blas_above), and so do batches where
the kernel is missing. On the CPU the weights are first moved into one buffer on huge pages (course.engine.arena;
the model's own parameters become views of it), which puts each layer's q, k and v weights side by side, so they are
read as one weight, and its gate and up weights as one: 4 products per layer instead of 7 (gpt-fast's Llama fuses
wq, wk, wv the same way). On the CPU, once a shape is warm, DecodeStep calls its compiled graph itself, without
TorchDynamo's lookup of the graph in between (Graphs: the inputs gathered where TorchDynamo found them): side by
side on the course's AMD EPYC, 0.971-0.986 of the time at B = 1 and 8 (0.3-0.6 ms a step). Elsewhere the per-call
work of torch.compile itself (its guards: checks that the inputs still match the compiled graph) is skipped once a
batch size is warm (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), which is safe here because every call
is shaped the same as its warm-up; with torch 2.13 on the AMD EPYC this measured no faster than checking them
(1.000-1.007 of the time). On the CPU the graph calls its kernels from C++ rather than Python (CPP_WRAPPER: about
5 % of the step at B = 1). On CUDA the step is captured as a CUDA graph (`mode="reduce-overhead"`), so one graph
launch replaces the hundreds of kernel launches of a step.

Prefill (many rows) is a matrix-matrix product that BLAS does well, so it stays eager.
The weights are not copied: the step reads the eager model's own parameters.
"""
from __future__ import annotations

import inspect
import math
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from course.engine import row_product
from course.engine.kv_cache import KVCache
from course.engine.model import Transformer, apply_rope
from course.engine.paged import PagedBatch, gather_blocks, write_slots
from course.engine.positions import Positions


class GemvLinear(nn.Linear):
    """nn.Linear that, inside torch.compile, writes a one-row product as a reduction Inductor can stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.shape[-2] == 1:
            return (x.unsqueeze(-2) * self.weight).sum(-1)  # [B, 1, 1, d] · [N, d] → [B, 1, N]
        return F.linear(x, self.weight, self.bias)


def use_gemv_linears(model: nn.Module) -> nn.Module:
    """Turn every plain nn.Linear of `model` into a GemvLinear, in place (eager results are identical)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = GemvLinear
    return model


# --- the step, as one function of tensors --------------------------------------------------------------------
def blas_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, d] · weightᵀ → [B, N] through BLAS (F.linear) at every batch size, compiled or not."""
    return F.linear(x, weight)


def streamed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, d] · weightᵀ ([N, d]) → [B, N]. One row (B = 1) inside torch.compile: the streamed reduction below,
    fused with its neighbours. A batch: BLAS's matrix-matrix product (F.linear), called from inside the graph;
    Inductor's code for the streamed form with a symbolic batch size measured many times slower in the whole
    step (`kvcourse bench`, decode_batch). Run eagerly, always F.linear (the streamed form would materialise a
    [N, B, d] product)."""
    if torch.compiler.is_compiling() and _one_row(x):
        return stream_product(x, weight)
    return F.linear(x, weight)


# Inductor's CPU code recomputes a cheap elementwise input of a reduction inside the reduction's loop. Fused into a
# one-row product, the RMSNorm of the residual stream (and the residual sums behind it) was recomputed for every
# weight row: 3072 times per layer for gate|up, 49152 times for the LM head. Writing any elementwise expression of
# more than 4 operations to a buffer first computes it once; the products' inner loops then read the normalised
# row, the norm's own weights (576 numbers, from cache) and the weight matrix. The course model, B = 1, context
# 64, side by side with the default on an AMD EPYC: 1 thread 0.985, 0.946 and 0.913 of the time in three runs,
# 2 threads 0.982 (outputs bit-identical).
COMPUTE_ONCE = {"realize_opcount_threshold": 4}

# Around its kernels Inductor writes a wrapper that calls them one after another, in Python by default: some 200
# calls per step of the course model, each a few microseconds. Its C++ wrapper (`cpp_wrapper=True`) makes the same
# calls from C++. The course model, context 64, 1 thread, side by side on an AMD EPYC: 0.946, 0.947 and 0.990 of
# the time at B = 1 in three runs (about 1.2 ms of a 21 ms step), 0.974 at B = 8; outputs bit-identical. It costs
# compile time: 65 against 45 s for the B = 1 graph, 94 against 59 s for the batch graph, on 2 cores, once (Inductor
# keeps the result on disk). DecodeStep uses it for its whole-step graphs on the CPU.
CPP_WRAPPER = {"cpp_wrapper": True}


class Graphs:
    """torch.compile's Inductor backend (the same compile_fx call, the same options) that also keeps each graph it
    compiles, so that DecodeStep can call a warm graph itself, without TorchDynamo in between.

    Every call through torch.compile first runs TorchDynamo's lookup of the compiled graph (its guards, or with
    skip_guard_eval_unsafe a shorter check) and the bytecode it wrote around the graph. Called directly, the course
    model's step took 0.986 (1 thread) and 0.974 (2 threads) of the time at B = 1 and 0.971 at B = 8 on the course's
    AMD EPYC (context 64, side by side, 12 paired rounds each; logits bit-identical): 0.3-0.6 ms of an 18-28 ms
    step. For the 2-layer test model a whole warm call took 46 against 83 µs. The any-shape path, which goes through
    TorchDynamo seven times a step (six groups of layers, the head), took 0.916 (1 thread) and 0.897 (2 threads) of
    the time at B = 1 and 0.908 at B = 8 (1 thread) with its graphs called directly. TorchDynamo records where it found
    each of the graph's inputs (the `source` of each placeholder, a Python expression over the function's arguments
    such as "L['ks'][3]"), so the same inputs can be gathered again from the next call's arguments and handed to the
    compiled graph.
    """

    def __init__(self, options: dict):
        self.options = options
        self.ran: Graph | None = None  # the graph TorchDynamo called last (set by Graph.__call__)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return Graph(self, compile_fx(gm, example_inputs, config_patches=self.options), gm)


class Graph:
    """One compiled graph: called by TorchDynamo with its inputs, or by `direct(names, arguments)` with the arguments
    of the compiled function (its inputs gathered from them where TorchDynamo found them; `inputs` is None when it
    cannot say)."""

    def __init__(self, owner: Graphs, compiled, gm: torch.fx.GraphModule):
        self.owner, self.compiled = owner, compiled
        names = []
        for node in gm.graph.find_nodes(op="placeholder"):
            arg = node.meta.get("grapharg")
            source = getattr(arg, "source", None)
            if source is None or getattr(arg, "pass_arg_as_tensor", False):  # an input only TorchDynamo can make
                names = None
                break
            names.append(source.name)
        # the sources are TorchDynamo's own expressions over the call's arguments L (and the module's globals G)
        self.inputs = None if names is None else eval(f"lambda L, G: ({''.join(n + ', ' for n in names)})", {})

    def __call__(self, *args):
        self.owner.ran = self
        return self.compiled(*args)

    def direct(self, names: tuple, arguments: tuple):
        """The graph's output for a call of the compiled function (a function of this module) with these arguments,
        named by `names` (its parameters' names, as TorchDynamo's sources call them)."""
        return self.compiled(*self.inputs(dict(zip(names, arguments)), _GLOBALS))


def _one_row(x: torch.Tensor) -> bool:
    """x holds one row for certain: True in the B = 1 graph; False for a symbolic batch (B >= 2, or the any-shape
    path's unbacked batch, where asking `x.shape[0] == 1` would be a data-dependent question the compiler rejects)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(x.shape[0] == 1)


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, d] · weightᵀ → [B, N] on course.engine.row_product's CPU kernel inside a compiled step (one row or
    a batch: each weight row is read once, prefetched ahead, and serves every sequence; above
    row_product.BLAS_ABOVE rows, 16 on Intel CPUs, the kernel calls BLAS). At B = 8 it kept the step near its
    B = 1 time where BLAS did not. Eagerly: F.linear."""
    if torch.compiler.is_compiling():
        return torch.ops.kvcourse.row_product(x, weight, row_product.BLAS_ABOVE)
    return F.linear(x, weight)


def batch_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """row_linear for a batch, Inductor's streamed reduction (stream_product) for one row: DecodeStep's choice on
    Intel CPUs. For one sequence the streamed reduction, fused with its neighbours, beat the kernel on the course's
    Sapphire Rapids hosts (in separate runs, side by side: 0.2–2.1 ms per step with 1 thread, 2.2–2.6 with 2, with
    Inductor's Python wrapper). On an AMD EPYC it did too until the step's graph called its kernels from C++
    (CPP_WRAPPER) and attention moved to its own kernel; since then the two are about as fast there (the kernel's
    step 0.93–1.03 of the streamed one's time in four paired comparisons at 1 and 2 threads), so DecodeStep uses
    row_linear for one row on other CPUs: every batch size runs the same product. `kvcourse bench`, decode_floor,
    times both. Eagerly: F.linear."""
    if torch.compiler.is_compiling():
        if _one_row(x):
            return stream_product(x, weight)
        return torch.ops.kvcourse.row_product(x, weight, row_product.BLAS_ABOVE)
    return F.linear(x, weight)


def stream_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, d] · weightᵀ ([N, d]) → [B, N], written so that Inductor reads each weight row once.

    B = 1: the row-vector product as a reduction over d. B > 1: the output is laid out [N, B] (weight row
    outermost, the B sequences next, d innermost), so one weight row serves every sequence from the cache.
    """
    if x.shape[0] == 1:
        return (x * weight).sum(-1, dtype=torch.float32).to(x.dtype)[None]  # [1, N]
    return (weight[:, None, :] * x[None]).sum(-1, dtype=torch.float32).to(x.dtype).t()  # [N, B] → [B, N]


def plain_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    hidden: torch.Tensor) -> torch.Tensor:
    """One new token's attention: q [B, H_kv, G, D_h] (G query heads per KV head), k_cache / v_cache [B, H_kv, S,
    D_h], hidden [B, 1, 1, S] (0 where a key is visible, -inf where not) → [B, H_kv, G, D_h]. Two batched matrix
    products around a softmax."""
    scores = (q.float() @ k_cache.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1])) + hidden  # [.., G, S]
    return torch.softmax(scores, dim=-1).to(q.dtype) @ v_cache


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     hidden: torch.Tensor) -> torch.Tensor:
    """plain_attention on course.engine.row_product's CPU kernel inside a compiled step (float32, where the row kernel
    computes the products): one call per layer instead of two batched matrix products, which BLAS makes as one small
    product per sequence and KV head (at 8 sequences, context 64, 1 thread on an AMD EPYC: about 55 µs each, 3.3 ms
    of a 30 ms step); keys the mask hides are skipped. Eagerly: plain_attention."""
    if torch.compiler.is_compiling():
        return torch.ops.kvcourse.decode_attention(q, k_cache, v_cache, hidden)
    return plain_attention(q, k_cache, v_cache, hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (course.engine.model.RMSNorm) as a function of tensors."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def decode_block(x: torch.Tensor, w: tuple[torch.Tensor, ...], eps: float, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, hidden: torch.Tensor, n_heads: int, n_kv_heads: int, gather: bool = False,
                 linear=streamed_linear, table: torch.Tensor | None = None) -> torch.Tensor:
    """One transformer block for B one-token rows x [B, d]; writes this step's K and V into the cache.

    w: the block's tensors (see `block_weights`); k_cache / v_cache [B_cache, H_kv, S, D_h]; rows [B], positions
    [B]: where each row's K/V go; cos / sin [B, 1, D_h]; hidden [B, 1, 1, S]: 0 where a key is visible, -inf where
    the sequence has not reached it. gather: rows is a subset of the cache's rows (attention reads a copy of them).
    table [B, n_blocks]: a paged cache instead (course.engine.paged): k_cache / v_cache are the layer's block
    pools [N_blocks, block_size, H_kv, D_h], rows are the pool slots this step writes (block · block_size +
    offset), and attention reads each sequence's blocks in table order (a gathered copy, S = n_blocks · block_size).
    """
    B, D_h = x.shape[0], k_cache.shape[-1]
    G = n_heads // n_kv_heads  # query heads per KV head
    h = rms_norm(x, w[-2], eps)  # [B, d]
    if len(w) == 6:  # fused (fused_block_weights): one product for q, k and v, one for gate and up
        wqkv, wo, w13, w_down = w[:4]
        qkv = linear(h, wqkv)  # [B, (H + 2 H_kv) D_h]
        nq, nkv = n_heads * D_h, n_kv_heads * D_h
        q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
    else:
        wq, wk, wv, wo, w_gate, w_up, w_down = w[:7]
        q, k, v = linear(h, wq), linear(h, wk), linear(h, wv)
    q = apply_rope(q.reshape(B, n_heads, D_h), cos, sin)  # [B, H, D_h]
    k = apply_rope(k.reshape(B, n_kv_heads, D_h), cos, sin)  # [B, H_kv, D_h]
    v = v.reshape(B, n_kv_heads, D_h)
    if table is not None:  # paged: write each sequence's slot, then gather its blocks
        write_slots(k_cache, rows, k)
        write_slots(v_cache, rows, v)
        k_cache, v_cache = gather_blocks(k_cache, table), gather_blocks(v_cache, table)  # [B, H_kv, S, D_h]
    else:
        k_cache[rows, :, positions] = k  # sequence b writes its K at (row b, position b): [B, H_kv, D_h]
        v_cache[rows, :, positions] = v
        if gather:
            k_cache, v_cache = k_cache[rows], v_cache[rows]  # [B, H_kv, S, D_h]
    attend = kernel_attention if linear in (row_linear, batch_row_linear) else plain_attention
    out = attend(q.view(B, n_kv_heads, G, D_h), k_cache, v_cache, hidden)  # [B, H_kv, G, D_h]
    x = x + linear(out.reshape(B, n_heads * D_h), wo)
    h = rms_norm(x, w[-1], eps)
    if len(w) == 6:
        gate_up = linear(h, w13)  # [B, 2 F]
        hidden_ff = w13.shape[0] // 2
        gate, up = gate_up[:, :hidden_ff], gate_up[:, hidden_ff:]
    else:
        gate, up = linear(h, w_gate), linear(h, w_up)
    return x + linear(F.silu(gate) * up, w_down)  # SwiGLU


def block_weights(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    """A TransformerBlock's tensors in the order decode_block takes them (no copies)."""
    att, ff = layer.attention, layer.feed_forward
    return (att.wq.weight, att.wk.weight, att.wv.weight, att.wo.weight, ff.w_gate.weight, ff.w_up.weight,
            ff.w_down.weight, layer.attention_norm.weight, layer.ffn_norm.weight)


def _side_by_side(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One [sum of rows, d] view over 2-D tensors that lie one after another in the same memory, else None."""
    first = ts[0]
    offset = first.storage_offset()
    for t in ts:
        if not (t.is_contiguous() and t.dim() == 2 and t.shape[1] == first.shape[1] and t.dtype == first.dtype
                and t.device == first.device and t.storage_offset() == offset
                and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in ts), first.shape[1]), (first.shape[1], 1))


@torch.no_grad()
def fused(params: list[nn.Parameter], rehome: bool | None = None) -> torch.Tensor | None:
    """The rows of `params` (weights [N_i, d]) as one [sum N_i, d] tensor that the parameters are views of.

    Where they already lie one after another (a CPU model packed by course.engine.arena.pack_parameters), the
    view over them, no copy. Otherwise, with rehome (the default off the CPU), the parameters are re-homed in
    place: their values are copied into one new buffer and each becomes a view of its rows (the values, and so
    the eager model's output, do not change; the memory they held is freed unless something else holds it).
    On the CPU a plain copy is not made (on small pages it measured slower than the original): None.
    """
    view = _side_by_side([p.detach() for p in params])
    if view is not None:
        return view
    if not (params[0].device.type != "cpu" if rehome is None else rehome):
        return None
    from course.engine.arena import move_into

    first = params[0]
    buffer = first.detach().new_empty(sum(p.shape[0] for p in params), first.shape[1])
    move_into(params, buffer.view(-1))
    return buffer


def fused_block_weights(layer: nn.Module, rehome: bool | None = None) -> tuple[torch.Tensor, ...]:
    """A TransformerBlock's tensors with q, k and v as one weight and gate and up as one (see `fused`):
    (wqkv, wo, w_gate_up, w_down, attention norm, ffn norm), so that a step makes 4 products per layer, not 7:
    fewer kernel calls, each reading one longer stretch of memory (gpt-fast's Llama fuses wq, wk, wv the same
    way). Where they cannot be fused without a copy, block_weights' nine tensors (decode_block takes either)."""
    att, ff = layer.attention, layer.feed_forward
    qkv = fused([att.wq.weight, att.wk.weight, att.wv.weight], rehome)
    gate_up = fused([ff.w_gate.weight, ff.w_up.weight], rehome)
    if qkv is None or gate_up is None:
        return tuple(t.detach() for t in block_weights(layer))
    return (qkv.detach(), att.wo.weight.detach(), gate_up.detach(), ff.w_down.weight.detach(),
            layer.attention_norm.weight.detach(), layer.ffn_norm.weight.detach())


def step_inputs(model: Transformer, positions: torch.Tensor, S: int):
    """What every block of a step shares: cos, sin [B, 1, D_h] and the visibility mask hidden [B, 1, 1, S]."""
    cos = model.rope_cos[positions].to(model.dtype)[:, None, :]
    sin = model.rope_sin[positions].to(model.dtype)[:, None, :]
    keys = torch.arange(S, device=positions.device)
    hidden = torch.where(keys[None, :] <= positions[:, None], 0.0, float("-inf"))  # [B, S]
    return cos, sin, hidden.to(model.dtype)[:, None, None, :]  # broadcast over KV heads and their groups


def decode_step(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor,
                ks: list[torch.Tensor], vs: list[torch.Tensor], rows: torch.Tensor | None = None,
                linear=streamed_linear, weights: list[tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor:
    """One decode step for B sequences, each at its own position; writes the cache in place.

    tokens [B, 1] (the latest token of each sequence), positions [B] (where it goes), ks / vs: every
    layer's preallocated cache buffers [B_cache, H_kv, S, D_h]; rows [B]: the cache row of each sequence
    (None: rows 0..B-1, the whole cache); weights: each layer's tensors (block_weights or fused_block_weights;
    None: block_weights of the model's layers). Returns next-token logits [B, V] in float32.
    Key j of sequence b is attended to iff j <= positions[b]: the buffer's length S never changes, so
    neither do the shapes of this function, whatever the context.
    """
    c = model.config
    cos, sin, hidden = step_inputs(model, positions, ks[0].shape[2])
    gather = rows is not None
    rows = torch.arange(tokens.shape[0], device=tokens.device) if rows is None else rows
    x = model.tok_embeddings(tokens[:, 0])  # [B, d]
    if weights is None:
        weights = [block_weights(layer) for layer in model.layers]
    for w, k_cache, v_cache in zip(weights, ks, vs):
        x = decode_block(x, w, c.norm_eps, k_cache, v_cache, rows, positions, cos, sin, hidden,
                         c.n_heads, c.n_kv_heads, gather, linear)
    return linear(rms_norm(x, model.norm.weight, c.norm_eps), model.output.weight).float()  # [B, V]


_GLOBALS = decode_step.__globals__  # G in TorchDynamo's names of the step's inputs
_STEP_ARGS = tuple(inspect.signature(decode_step).parameters)  # ... and L's names: model, tokens, positions, ...


def decode_blocks(x: torch.Tensor, ws: tuple, eps: float, ks: list[torch.Tensor], vs: list[torch.Tensor],
                  rows: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  hidden: torch.Tensor, n_heads: int, n_kv_heads: int, gather: bool = False, linear=streamed_linear,
                  table: torch.Tensor | None = None) -> torch.Tensor:
    """decode_block for several consecutive layers: ws, ks, vs hold one entry per layer."""
    for w, k_cache, v_cache in zip(ws, ks, vs):
        x = decode_block(x, w, eps, k_cache, v_cache, rows, positions, cos, sin, hidden, n_heads, n_kv_heads, gather,
                         linear, table)
    return x


def layer_group(n_layers: int, most: int = 5) -> int:
    """How many layers one compiled call of the any-shape step runs: the largest divisor of n_layers up to `most`
    (fewer calls from Python per step, against a longer compile)."""
    return max(d for d in range(1, most + 1) if n_layers % d == 0)


def lm_head(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
            linear=streamed_linear) -> torch.Tensor:
    """The final RMSNorm and the LM head: x [B, d] → logits [B, V] in float32."""
    return linear(rms_norm(x, norm_weight, eps), weight).float()


_BLOCK_ARGS = tuple(inspect.signature(decode_blocks).parameters)  # the names TorchDynamo's sources use (L['x'], ...)
_HEAD_ARGS = tuple(inspect.signature(lm_head).parameters)


def _repeats(graph: Graph | None, names: tuple, args: tuple, out: torch.Tensor) -> Graph | None:
    """The graph TorchDynamo just called for `args` (the compiled function's arguments, by `names`), if called directly
    with the same arguments it gives the same output `out`; None otherwise. Only for calls that can be repeated: a
    step's group of layers writes this token's K and V where the first call wrote them, the head writes nothing."""
    if graph is None or graph.inputs is None:
        return None
    try:
        again = graph.direct(names, args)
    except Exception:  # an input TorchDynamo found where the arguments cannot say: keep calling through it
        return None
    return graph if len(again) == 1 and torch.equal(again[0], out) else None


class DecodeStep:
    """`step(tokens [B, 1], positions [B], cache) → logits [B, V]`: the decode step, compiled once per batch size.

    The cache is a contiguous course.engine.kv_cache.KVCache, written in place at each sequence's position,
    or a course.engine.paged.PagedBatch (one token per sequence), written into its pool slots and read through
    its block table. Batch size 1 compiles one graph and every batch of 2 or more shares a second one (its batch
    dimension symbolic; dynamic_batch=False compiles each size on its own); each cache length, dtype and device
    compiles once too, the first time it is seen (tens of seconds on 2 CPU cores; Inductor keeps the result on disk,
    so a later process starts in seconds); after that the same shapes run without recompiling and, from the second
    call, without TorchDynamo (direct, on the CPU: see Graphs) or without evaluating guards. compile=False runs the
    same function eagerly (the reference the tests compare against). If compiling fails (no C++ compiler, an
    unsupported backend) it warns once and runs eagerly.

    any_shape=True, for a server whose batch and contexts change at every step: one compiled group of layers
    (decode_blocks over `layer_group` layers: 5 of the course model's 30), called from Python for each group in
    turn, and one compiled LM head serve every batch size (1 included: the batch dimension is unbacked,
    torch._dynamo.mark_unbacked, so 1 is not special), every cache length and every number of cache rows.
    Three kinds of call compile one group each, the first time they are seen: the whole cache or consecutive
    rows of it (read as views, no copy), any other set of rows (attention reads a gathered copy of them), and a
    paged batch (each sequence's blocks gathered through its block table). On the course's 2-core CPUs a group
    compiled in seconds where the whole 30-layer step took about a minute; the price is the Python between the
    groups at every step (`kvcourse bench`, decode_batch, times the two side by side). The whole-step graphs
    stay the default: they are the fastest for one sequence. A paged
    batch's block table grows with its longest sequence, so paged batches always take the any-shape path.
    On CUDA the any-shape path runs without CUDA graphs (a graph is recorded per shape).

    fuse (default True): q|k|v and gate|up read as one weight each (fused_block_weights; on the CPU after
    course.engine.arena.pack_parameters moved the model's weights into one huge-page buffer, elsewhere by
    re-homing each group's parameters into one tensor). one_row_kernel: B = 1 on the row kernel too, instead of
    Inductor's streamed reduction (None: except on Intel CPUs; see batch_row_linear; the bench times the two side
    by side). cpp_wrapper (None: on the CPU, not under CUDA graphs): the whole-step graphs call their kernels from
    C++ rather than Python (CPP_WRAPPER). direct (None: on the CPU, not under CUDA graphs): a warm whole-step graph
    is called by this class with the inputs TorchDynamo would give it (Graphs), once the warm-up's step, repeated
    that way, gave the same logits; the warm-up key includes the cache buffers' strides, so a cache laid out
    differently is warmed (and checked) through TorchDynamo first. The any-shape path does the same for its group
    and head graphs, once per kind, after its first call repeated the first group and the head that way.
    """

    def __init__(self, model: Transformer, compile: bool = True, mode: str | None = None,
                 skip_guards: bool = True, dynamic_batch: bool = True, product: str = "stream",
                 row_kernel: bool | None = None, any_shape: bool = False, fuse: bool = True,
                 one_row_kernel: bool | None = None, cpp_wrapper: bool | None = None, direct: bool | None = None):
        if product not in ("stream", "blas"):
            raise ValueError(f"product must be 'stream' (one row: Inductor's streamed reduction) or 'blas', got {product!r}")
        self._linear = streamed_linear if product == "stream" else blas_linear
        # the products of a compiled float32 CPU step: course.engine.row_product's kernel (row_kernel None: where it
        # builds; True: required; False: not used, Inductor's streamed reduction for one row and BLAS for batches)
        self.row_kernel = False
        if product == "stream" and compile and row_kernel is not False and model.device.type == "cpu" \
                and model.dtype == torch.float32:
            self.row_kernel = row_product.available()
            if row_kernel and not self.row_kernel:
                raise RuntimeError(f"the batched decode kernel is not available: {row_product.why_not()}")
            if one_row_kernel is None:  # one row: the kernel, except on Intel CPUs (see batch_row_linear)
                from course.engine.device import cpu_vendor

                one_row_kernel = cpu_vendor() != "GenuineIntel"
            if self.row_kernel:  # one row: Inductor's streamed reduction, unless one_row_kernel (the kernel there too)
                self._linear = row_linear if one_row_kernel else batch_row_linear
        self.one_row_kernel = self._linear is row_linear
        self.product = product
        self.model = model
        # fuse: the weights in one huge-page buffer on the CPU (course.engine.arena: the model's own parameters
        # become views of it, values unchanged), q, k, v read as one weight and gate, up as one (fused_block_weights)
        self.fuse = fuse
        if fuse and model.device.type == "cpu":
            from course.engine.arena import pack_parameters

            pack_parameters(model)
        self._layer_weights = [fused_block_weights(layer) if fuse else tuple(t.detach() for t in block_weights(layer))
                               for layer in model.layers]
        self.compiled = compile
        if mode is None:
            mode = "reduce-overhead" if model.device.type == "cuda" else "default"
        self.mode = mode
        self.skip_guards = skip_guards and compile
        # dynamic=None: shapes start static; only what dynamic_batch marks (the batch dimension) is symbolic, so
        # B = 1 gets its own graph and every B >= 2 shares one (compiling is what costs: minutes per graph on 2 busy cores)
        self.dynamic_batch = dynamic_batch
        self.any_shape = any_shape
        self._block_options = {"size_asserts": False}  # the any-shape path's block and head: compiled when first used
        self._block = self._head = self._weights = self._head_weights = self._block_graphs = None
        # Inductor's per-call checks of every input's size and stride (hundreds per step) are off: the guards
        # and this class's own checks already pin the shapes. reduce-overhead = CUDA graphs.
        # cpp_wrapper (None: on the CPU): Inductor writes the code that calls the step's kernels in C++ instead of
        # Python (see CPP_WRAPPER)
        if cpp_wrapper is None:
            cpp_wrapper = model.device.type == "cpu" and mode == "default"
        self.cpp_wrapper = bool(cpp_wrapper and compile)
        options = {"size_asserts": False, **({"triton.cudagraphs": True} if mode == "reduce-overhead" else {}),
                   **(COMPUTE_ONCE if model.device.type == "cpu" else {}),
                   **(CPP_WRAPPER if self.cpp_wrapper else {})}
        how = dict(options=options) if mode in ("default", "reduce-overhead") else dict(mode=mode)
        # direct (None: on the CPU, without CUDA graphs): a warm graph is called by this class itself, without
        # TorchDynamo's lookup in between (see Graphs); CUDA graphs stay with torch.compile, which manages them
        if direct is None:
            direct = model.device.type == "cpu" and mode == "default"
        self._graphs = Graphs(options) if direct and compile and mode == "default" else None
        if self._graphs is not None:
            how = dict(backend=self._graphs)
        self._fn = torch.compile(decode_step, dynamic=None, fullgraph=True, **how) if compile else decode_step
        self.direct = self._graphs is not None
        self._direct: dict[tuple, Graph] = {}  # warm shapes whose graph this class calls itself
        self._warm: set[tuple] = set()
        self._checked = weakref.WeakSet()  # caches whose every buffer was checked once
        self._dtype, self._device = model.dtype, model.device  # read once: properties cost per call

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def buffers(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The cache's K and V buffers, checked (once per cache) to be the plain kind this step writes."""
        try:
            ks, vs = [layer.k for layer in cache.layers], [layer.v for layer in cache.layers]
        except AttributeError:
            raise TypeError(f"DecodeStep writes a contiguous KVCache; got {type(cache).__name__}") from None
        if cache in self._checked and ks[0].dtype == self._dtype:
            return ks, vs
        if any(type(layer) is not type(cache.layers[0]) for layer in cache.layers):
            raise TypeError(f"the cache has {len(ks)} layers of mixed or wrong kind; the model has {self.config.n_layers}")
        self._check_buffers(ks, vs, "cache")
        self._checked.add(cache)
        return ks, vs

    def _check_buffers(self, ks: list[torch.Tensor], vs: list[torch.Tensor], what: str):
        """One buffer per layer for K and V, of the model's dtype on its device."""
        if len(ks) != self.config.n_layers or len(vs) != len(ks):
            raise TypeError(f"the {what} has {len(ks)} layers of mixed or wrong kind; the model has {self.config.n_layers}")
        if any(k.dtype != self.dtype or k.device != self.device for k in ks + vs):
            raise TypeError(f"the {what} must hold {self.dtype} on {self.device}, like the model; "
                            f"got {ks[0].dtype} on {ks[0].device}")
        # a warm graph is called without TorchDynamo's guards (see Graphs), which would have caught another layout
        odd = next((t for t in ks + vs if not t.is_contiguous()), None)
        if odd is not None:
            raise TypeError(f"the {what}'s K and V buffers must be contiguous, as KVCache allocates them; got one of "
                            f"shape {list(odd.shape)} with strides {list(odd.stride())}: pass .contiguous() copies")
        return ks, vs

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions, cache: KVCache | PagedBatch, rows=None) -> torch.Tensor:
        """tokens [B, 1]; positions: a [B] tensor, a list of B ints or one int for all; rows: the cache
        row of each sequence (None: the cache holds exactly these B sequences, rows 0..B-1). A PagedBatch
        (PagedKVCache.append or PagedBatch(...) with one new token per sequence) brings its own positions."""
        if isinstance(cache, PagedBatch):
            return self._paged(tokens, positions, cache)
        ks, vs = self.buffers(cache)
        B_cache, S = ks[0].shape[0], ks[0].shape[2]
        B = B_cache if rows is None else len(rows)
        if self.any_shape and rows is not None and not isinstance(rows, torch.Tensor) and len(rows) == B:
            rows = [int(r) for r in rows]
            if not 0 <= min(rows) <= max(rows) < B_cache:
                raise ValueError(f"cache rows {rows} do not exist in a cache of {B_cache} rows")
            first = rows[0]
            if rows == list(range(first, first + B)):  # consecutive rows: views of them, no copy
                ks, vs = [k[first:first + B] for k in ks], [v[first:first + B] for v in vs]
                B_cache, rows = B, None
        if tokens.dim() != 2 or tokens.shape != (B, 1):
            raise ValueError(f"tokens must be [B, 1] = [{B}, 1] (one new token per sequence), got {list(tokens.shape)}")
        if isinstance(positions, int):  # one position for every row: checked here, no device sync
            if not 0 <= positions < S:
                raise ValueError(f"KV cache overflow: position {positions} does not fit in a cache of {S} tokens; "
                                 "create the cache with a larger max_seq_len")
            positions = [positions] * B
        elif isinstance(positions, (list, tuple)) and positions and not 0 <= min(positions) <= max(positions) < S:
            raise ValueError(f"KV cache overflow: positions {min(positions)}..{max(positions)} do not fit in a "
                             f"cache of {S} tokens; create the cache with a larger max_seq_len")
        # Fresh [B] and [B, 1] tensors made here, in inference mode: the graph's guards see the same kind of
        # tensor on every call, whether the caller's came from inside or outside inference mode.
        positions = torch.as_tensor(positions, device=self.device).to(torch.long, copy=True)
        tokens = tokens.to(torch.long, copy=True)
        if positions.shape != (B,):
            raise ValueError(f"positions must be [B] = [{B}], one per sequence; got shape {list(positions.shape)}")
        if rows is not None:
            rows = torch.as_tensor(rows, device=self.device).to(torch.long, copy=True)
        if self.any_shape:
            if rows is not None:  # views of the whole buffers: the compiler's marks of symbolic sizes stay off the
                ks, vs = [k[:] for k in ks], [v[:] for v in vs]  # cache's own tensors (a whole-step graph may read them)
            kind = ("rows" if rows is not None else "views", B_cache >= 2, S >= 2)
            return self._any_shape(tokens, positions, ks, vs, rows, None, kind, B_cache)
        # torch.compile guards on the thread count too (Inductor's CPU kernels are built for it): a new count
        # is a new graph, compiled (and warmed) like a new shape
        key = (B, B_cache, S, rows is None, self.dtype, self.device.type, ks[0].is_inference(),
               torch.get_num_threads(), ks[0].stride())
        graph = self._direct.get(key)
        if graph is not None:  # warm, and called directly: the same inputs TorchDynamo would hand the graph
            return graph.direct(_STEP_ARGS, self._step_args(tokens, positions, ks, vs, rows))[0]
        if key not in self._warm:  # first call of these shapes: check the values once, then compile
            last = int(positions.max())
            if int(positions.min()) < 0 or last >= S:
                raise ValueError(f"KV cache overflow: position {last} does not fit in a cache of {S} tokens; "
                                 "create the cache with a larger max_seq_len")
            if rows is not None and (int(rows.min()) < 0 or int(rows.max()) >= B_cache):
                raise ValueError(f"cache rows {rows.tolist()} do not exist in a cache of {B_cache} rows")
            if self.compiled and self.dynamic_batch and B >= 2:  # one graph for every batch of 2 or more
                for t in (tokens, positions, *ks, *vs, *(() if rows is None else (rows,))):
                    torch._dynamo.mark_dynamic(t, 0)
            if self.mode == "reduce-overhead":  # CUDA graphs may then write the cache buffers in place, and
                for t in ks + vs + [w for ws in self._layer_weights for w in ws]:  # read the weights where they are
                    torch._dynamo.mark_static_address(t)
            if self._graphs is not None:
                self._graphs.ran = None
            out = self._run(tokens, positions, ks, vs, rows)
            self._warm.add(key)
            if self._graphs is not None and self.compiled:  # call the graph TorchDynamo chose directly from now on,
                graph = _repeats(self._graphs.ran, _STEP_ARGS,  # if so it repeats this step's logits
                                 self._step_args(tokens, positions, ks, vs, rows), out)
                if graph is not None:
                    self._direct[key] = graph
            return out
        if self.skip_guards:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out = self._fn(self.model, tokens, positions, ks, vs, rows, self._linear, self._layer_weights)
                return out.clone() if self.mode == "reduce-overhead" else out  # CUDA graphs reuse the output
            except RuntimeError as exc:  # these inputs differ from every warm-up in a way the key missed:
                if "skip_guard_eval_unsafe" not in str(exc):  # check the guards from now on
                    raise
                warnings.warn(f"DecodeStep: inputs unlike its warm-up ({exc}); evaluating guards from now on")
                self.skip_guards = False
        return self._run(tokens, positions, ks, vs, rows)

    def _paged(self, tokens: torch.Tensor, positions, batch: PagedBatch) -> torch.Tensor:
        """One decode step over a paged batch: write each sequence's slot, attend over its blocks."""
        if batch.packed or batch.n_new != 1:
            raise ValueError("the compiled step decodes one new token per sequence; this paged batch holds "
                             f"{batch.n_new} (prefill goes through the eager model)")
        B = len(batch.seq_ids)
        if tokens.dim() != 2 or tokens.shape != (B, 1):
            raise ValueError(f"tokens must be [B, 1] = [{B}, 1] (one new token per sequence), got {list(tokens.shape)}")
        batch.check_call(positions, 1)
        ks, vs = self._check_buffers(batch.cache.k, batch.cache.v, "paged cache")
        positions = torch.as_tensor(batch.positions.start, device=self.device).to(torch.long, copy=True)
        table = batch.block_table.clone()
        if table.shape[1] == 1:  # one block each: read it twice (the mask hides the copy), so that the block count
            table = table.repeat(1, 2)  # is never 1, which the compiler would make a graph of its own
        kind = ("paged", ks[0].shape[0] >= 2)  # what the compiler's marks depend on (a pool of 1 block stays static)
        return self._any_shape(tokens.to(torch.long, copy=True), positions, ks, vs, batch.write_slots.clone(), table,
                               kind, ks[0].shape[0])

    def _any_shape(self, tokens, positions, ks, vs, rows, table, kind: tuple, B_cache: int) -> torch.Tensor:
        """The any-shape path: each compiled group of layers in turn, then the compiled head (see the class doc)."""
        key = (kind, self.dtype, self.device.type, ks[0].is_inference(), torch.get_num_threads())
        first = key not in self._warm
        if first and table is None:  # the values, checked once per kind (lists and ints are checked every call)
            if int(positions.min()) < 0 or int(positions.max()) >= ks[0].shape[2]:
                raise ValueError(f"KV cache overflow: position {int(positions.max())} does not fit in a cache of "
                                 f"{ks[0].shape[2]} tokens; create the cache with a larger max_seq_len")
            if rows is not None and (int(rows.min()) < 0 or int(rows.max()) >= B_cache):
                raise ValueError(f"cache rows {rows.tolist()} do not exist in a cache of {B_cache} rows")
        if self._block is None:
            if self.compiled:
                how = dict(options=self._block_options)
                if self.direct:  # the block and head graphs are called directly too, once warm (see _blockwise)
                    self._block_graphs = Graphs(self._block_options)
                    how = dict(backend=self._block_graphs)
                self._block = torch.compile(decode_blocks, dynamic=None, fullgraph=True, **how)
                self._head = torch.compile(lm_head, dynamic=None, fullgraph=True, **how)
            else:
                self._block, self._head = decode_blocks, lm_head
            # plain tensors (no copies): the group takes its layers' weights as inputs, every group of the same shapes
            weights = self._layer_weights
            g = self._group = layer_group(len(weights))
            self._weights = [tuple(weights[i:i + g]) for i in range(0, len(weights), g)]
            self._head_weights = (self.model.norm.weight.detach(), self.model.output.weight.detach())
        try:
            out = self._blockwise(tokens, positions, ks, vs, rows, table, mark=first and self.compiled,
                                  skip=not first and self.skip_guards, key=key)
        except Exception as exc:
            if not self.compiled:
                raise
            if not first:  # a warm kind: only inputs its warm-up did not cover are handled here
                if "skip_guard_eval_unsafe" not in str(exc):
                    raise
                warnings.warn(f"DecodeStep: inputs unlike its warm-up ({exc}); evaluating guards from now on")
                self.skip_guards = False
                out = self._blockwise(tokens, positions, ks, vs, rows, table, mark=False, skip=False)
            else:
                self._decode_eagerly(exc)
                out = self._blockwise(tokens, positions, ks, vs, rows, table, mark=False, skip=False)
        self._warm.add(key)
        return out

    def _blockwise(self, tokens, positions, ks, vs, rows, table, mark: bool, skip: bool,
                   key: tuple | None = None) -> torch.Tensor:
        """One step through the groups; mark: the first call of a kind, whose sizes the compiler traces as symbols;
        key: the kind's, under which its warm block and head graphs are called directly (see Graphs)."""
        m, c = self.model, self.config
        B = tokens.shape[0]
        S = ks[0].shape[2] if table is None else table.shape[1] * ks[0].shape[1]
        cos, sin, hidden = step_inputs(m, positions, S)
        gather = rows is not None and table is None
        index = torch.arange(B, device=tokens.device) if rows is None else rows
        x = m.tok_embeddings(tokens[:, 0])  # [B, d]
        g = self._group

        def block_args(i: int, x: torch.Tensor) -> tuple:
            return (x, self._weights[i], c.norm_eps, ks[i * g:(i + 1) * g], vs[i * g:(i + 1) * g], index, positions,
                    cos, sin, hidden, c.n_heads, c.n_kv_heads, gather, self._linear, table)

        head_args = (self._head_weights[0], self._head_weights[1], c.norm_eps, self._linear)
        direct = self._direct.get(key)
        if direct is not None:  # warm: each group's graph and the head's, called without TorchDynamo
            block, head = direct
            for i in range(len(self._weights)):
                x = block.direct(_BLOCK_ARGS, block_args(i, x))[0]
            return head.direct(_HEAD_ARGS, (x, *head_args))[0]
        if mark:  # what changes between a server's steps is symbolic in the traced block and head
            unbacked = torch._dynamo.decorators.mark_unbacked
            for t in (x, cos, sin, hidden, index, positions, *(() if table is None else (table,))):
                unbacked(t, 0)  # the batch: unbacked, so that B = 1 shares the graph
            if table is not None:
                torch._dynamo.mark_dynamic(table, 1)  # blocks per sequence (2 or more, see _paged)
            if S >= 2:
                torch._dynamo.mark_dynamic(hidden, 3)  # the keys attention sees
            for t in (*ks[:g], *vs[:g]):  # the first group's buffers are traced; the others match them
                if rows is None and table is None:
                    unbacked(t, 0)  # views of the batch's own rows: as many as the batch
                elif t.shape[0] >= 2:
                    torch._dynamo.mark_dynamic(t, 0)  # cache rows, or pool blocks
                if table is None and t.shape[2] >= 2:
                    torch._dynamo.mark_dynamic(t, 2)  # the cache length
        learn = self._block_graphs is not None and key is not None and key not in self._warm
        with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
            for i in range(len(self._weights)):
                args = block_args(i, x)
                if learn:
                    self._block_graphs.ran = None
                x = self._block(*args)
                if learn and i == 0:
                    block = _repeats(self._block_graphs.ran, _BLOCK_ARGS, args, x)
            if mark:
                torch._dynamo.decorators.mark_unbacked(x, 0)
            if learn:
                self._block_graphs.ran = None
            out = self._head(x, *head_args)
        if learn and block is not None:
            head = _repeats(self._block_graphs.ran, _HEAD_ARGS, (x, *head_args), out)
            if head is not None:
                self._direct[key] = (block, head)
        return out

    def _step_args(self, tokens, positions, ks, vs, rows) -> tuple:
        """decode_step's arguments, in the order of _STEP_ARGS."""
        return self.model, tokens, positions, ks, vs, rows, self._linear, self._layer_weights

    def _run(self, tokens, positions, ks, vs, rows):
        args = self._step_args(tokens, positions, ks, vs, rows)
        try:
            out = self._fn(*args)
        except Exception as exc:
            if self._fn is decode_step:
                raise
            self._decode_eagerly(exc)
            out = decode_step(*args)
        return out.clone() if self.mode == "reduce-overhead" else out  # a CUDA graph reuses its output buffer

    def _decode_eagerly(self, exc: Exception) -> None:
        """Compiling failed: warn once and run every path of the step eagerly from now on. Inductor needs a
        working C++ compiler on CPU; never fail a lesson for speed."""
        warnings.warn(f"torch.compile failed ({type(exc).__name__}: {exc}); decoding eagerly instead")
        self._fn, self.compiled, self.skip_guards, self.direct = decode_step, False, False, False
        self._direct.clear()
        if self._block is not None:
            self._block, self._head = decode_blocks, lm_head

    def __repr__(self) -> str:
        return f"DecodeStep({self.config.name}, compiled={self.compiled}, mode={self.mode!r})"


class FastModel:
    """Wraps a course Transformer with the model's call signature: decode steps run the compiled DecodeStep.

    A decode step is one token per sequence against a contiguous KVCache, at one position for all (an int) or
    one per sequence (a list, a [B] tensor or a positions.Positions, whose rows pick the cache rows), or
    against a paged batch (course.engine.paged.PagedBatch, one token per sequence), so `generate`,
    `decode_one_token` and the serving scheduler's batched step run compiled unchanged. Prefill (more than one
    token, or a packed row of prompts and decode tokens), calls without a cache and other caches (a single
    paged sequence, INT8) go to the eager model. any_shape: see DecodeStep (one graph for a server's changing
    batches).
    """

    def __init__(self, model: nn.Module, compile: bool = True, mode: str | None = None, any_shape: bool = False):
        self.model = model
        self.step = DecodeStep(model, compile=compile, mode=mode, any_shape=any_shape)
        self._decode = self._step_call

    @property
    def compiled(self) -> bool:
        return self.step.compiled

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def _step_call(self, tokens, start_pos=0, cache=None, last_only=False):
        rows = None
        if isinstance(start_pos, Positions):  # the serving engine's per-sequence positions and cache rows
            start_pos, rows = start_pos.start, start_pos.rows
        logits = self.step(tokens, start_pos, cache, rows=rows)  # [B, V]
        return logits if last_only else logits[:, None]  # [B, 1, V] like the model's full output

    def __call__(self, tokens: torch.Tensor, start_pos: int = 0, cache=None, last_only: bool = False):
        if type(cache) is PagedBatch and tokens.shape[1] == 1 and not cache.packed:
            logits = self.step(tokens, start_pos, cache)  # [B, V]
            return logits if last_only else logits[:, None]
        if cache is None or tokens.shape[1] != 1 or not isinstance(cache, KVCache) or type(cache) is not KVCache:
            return self.model(tokens, start_pos=start_pos, cache=cache, last_only=last_only)
        return self._decode(tokens, start_pos=start_pos, cache=cache, last_only=last_only)

    def __repr__(self) -> str:
        return f"FastModel({self.config.name}, compiled={self.compiled})"
