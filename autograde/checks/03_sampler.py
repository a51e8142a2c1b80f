"""Checks for exercise 03 (the sampler): one list per test cell.

Filters are compared on their returned logits (which tokens stay finite, and that kept logits keep their
values); probabilities within 1e-6; sampled frequencies against the reference sampler's own frequencies.
Ties in top-k: every token tied with the k-th largest logit stays (so more than k may survive), as the
notebook says. Every function must leave the caller's logits as they were (the notebook's own tests call them
twice on one tensor), at every temperature (T = 1 and T = 0 too), and every check passes its own copy of a shared
constant, so that one function writing into its input cannot change another check's input. `sample` must draw with
the generator it is given, not the global RNG, for [V] logits as for [B, V]. Greedy (T = 0):
each row's argmax, the lowest id on a tie; probabilities in float32 whatever the logits' dtype (both stated in the
notebook). Draws whose ids a correct sampler may choose differently come back raw and are judged here by the
relations the notebook asks for (a seed repeats its draw, another seed or the next draw does not).
"""
import torch

from course.grade.plain import Array
from course.grade.verdicts import Check, close, exact, raises


def frequencies(n: int, sigmas: float = 6.0):
    """Sampled frequencies (arrays) vs the reference's: zero where the reference is zero, else within
    `sigmas` standard deviations of the difference of two independent n-sample estimates."""
    import numpy as np

    def compare(got, ref) -> bool:
        if not (isinstance(got, Array) and isinstance(ref, Array) and got.data.shape == ref.data.shape):
            return False
        g, r = got.data.astype(np.float64), ref.data.astype(np.float64)
        if not np.all(np.isfinite(g)) or np.any(g[r == 0] != 0):
            return False
        tol = sigmas * np.sqrt(2 * np.clip(r, 1e-12, 1) * (1 - np.clip(r, 0, 1)) / n) + 1e-9
        return bool(np.all(np.abs(g - r) <= tol))

    return compare


def pair_equal(got, ref) -> bool:
    """The learner's value is a pair of equal arrays (a repeatable draw); the reference's pair is too."""
    return (isinstance(got, tuple) and len(got) == 2 and all(isinstance(x, Array) for x in got)
            and exact(got[0], got[1]) and got[0].data.shape == ref[0].data.shape)


LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
ROWS = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.4, 0.6]])
FILTERED = close(0.0)  # the same -inf pattern and exactly the same kept logits
N = 20_000


def fresh(x):
    """A copy of a shared constant tensor for each call, so that a function writing into its input cannot change
    what another check (or the reference's run) passes in."""
    return x.clone() if isinstance(x, torch.Tensor) else x


def call(name, *args, **kw):
    return lambda ns: ns[name](*[fresh(a) for a in args], **{k: fresh(v) for k, v in kw.items()})


def temperature_order(ns):
    return (ns["apply_temperature"](LOGITS.clone(), 0.5).softmax(-1).max(),
            ns["apply_temperature"](LOGITS.clone(), 2.0).softmax(-1).max())


def draws(seed, logits, n, **kw):
    def run(ns):
        ids = ns["sample"](logits.expand(n, -1).clone() if logits.dim() == 1 else logits.repeat(n, 1),
                           generator=torch.Generator().manual_seed(seed), **kw)
        V = logits.shape[-1]
        if logits.dim() == 1:
            return (tuple(ids.shape), torch.bincount(ids, minlength=V).double() / n)
        per_row = ids.view(n, logits.shape[0])
        return (tuple(ids.shape), torch.stack([torch.bincount(per_row[:, r], minlength=V).double() / n
                                               for r in range(logits.shape[0])]))
    return run


def shape_and(compare):
    return lambda got, ref: (isinstance(got, tuple) and len(got) == 2 and exact(got[0], ref[0])
                             and compare(got[1], ref[1]))


def repeat_draw(ns):
    rows = torch.tensor([[0.0, 5.0, 1.0], [3.0, -1.0, 2.0]]).repeat(50, 1)
    a = ns["sample"](rows, top_k=2, generator=torch.Generator().manual_seed(11))
    b = ns["sample"](rows, top_k=2, generator=torch.Generator().manual_seed(11))
    return (a, b)


def single(ns):
    one = ns["sample"](torch.tensor([0.0, 1.0, 2.0]), generator=torch.Generator().manual_seed(3))
    return tuple(one.shape)


TIES = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0], [5.0, 5.0, 5.0, 1.0, 0.0]])
P_ROWS = torch.tensor([[0.1, 0.6, 0.3], [0.35, 0.4, 0.25]]).log()
COMBINED = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()  # top-2 then top-p 0.5 keeps 1 token; the other order keeps 2
INF = float("inf")
# Logits of 0 and -inf only: every softmax is k equal shares of 1/k, exact in float32 however it is computed, so
# the running total lands exactly on p = 0.5 (and 0.25). Ties make WHICH tokens stay a matter of sort order, so
# the check counts them: a row of 8 keeps 4 at p = 0.5, one of 4 keeps 2, [.5, .5] keeps 1.
EXACT_SHARES = torch.tensor([[0.0] * 8, [0.0] * 4 + [-INF] * 4, [0.0, -INF, 0.0] + [-INF] * 5, [0.0] + [-INF] * 7])
UNCHANGED = "the caller's logits must not change"
NUCLEUS_FULL = ("hint: drop a token when the mass before it is >= p: once the kept tokens add up to exactly p, the "
                "nucleus is full")
GREEDY_ROWS = torch.tensor([[0.0, 5.0, 1.0, 4.0], [3.0, -1.0, 2.0, 7.0], [2.0, 6.0, 6.0, -1.0],
                            [1.0, 1.0, 1.0, 1.0]])  # each row's maximum elsewhere; rows 3 and 4 tie
MIXED = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0], [0.0, -2.0, 1.5, 1.0, 0.5]])


def kept_per_row(p):
    return lambda ns: torch.isfinite(ns["top_p_filter"](EXACT_SHARES.clone(), p)).sum(-1)


def input_after(use):
    """The caller's logits after `use(ns, logits)`: the notebook's own tests call a function again on the same
    tensor, so none of them may write into its input (masked_fill_, /=, div_ ...)."""
    def run(ns):
        logits = MIXED.clone()
        use(ns, logits)
        return logits
    return run


def generator_decides(ns):
    """Under one global seed, two generator seeds draw (a, b); under another global seed, a's generator seed draws
    again (c). 200 draws from 64 equally likely tokens each; judged outside: a != b and a == c. The global RNG's
    state is put back afterwards."""
    flat = torch.zeros(200, 64)
    state = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        a = ns["sample"](flat, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        b = ns["sample"](flat, generator=torch.Generator().manual_seed(2))
        torch.manual_seed(1)
        c = ns["sample"](flat, generator=torch.Generator().manual_seed(1))
    finally:
        torch.set_rng_state(state)
    return (a, b, c)


def ids_of(got, ref, V=64) -> bool:
    """got is an int array of ref's shape and dtype kind, every id in 0 .. V-1."""
    return (isinstance(got, Array) and isinstance(ref, Array) and got.data.shape == ref.data.shape
            and got.data.dtype.kind in "iu" and bool(((got.data >= 0) & (got.data < V)).all()))


def same(x, y) -> bool:
    return bool((x.data == y.data).all())


def seeds_decide(got, ref) -> bool:
    """(a, b, c) of generator_decides: other seeds draw otherwise (a != b), the same seed draws the same (a == c),
    whatever the global RNG; the reference's draws obey the same relations."""
    return (isinstance(got, tuple) and len(got) == 3 and all(ids_of(g, ref[0]) for g in got)
            and not same(got[0], got[1]) and same(got[0], got[2])
            and not same(ref[0], ref[1]) and same(ref[0], ref[2]))


def one_generator_twice(ns):
    """Two draws in a row with ONE generator (its state advances: they differ, with chance 1 - 64**-200), then the
    global RNG's next numbers after a seeded reset and a sample that was given a generator (it must not touch the
    global RNG: those numbers are the ones the reference sees)."""
    flat = torch.zeros(200, 64)
    state = torch.get_rng_state()
    try:
        generator = torch.Generator().manual_seed(21)
        a = ns["sample"](flat, generator=generator)
        b = ns["sample"](flat, generator=generator)
        torch.manual_seed(123)
        ns["sample"](flat, generator=torch.Generator().manual_seed(5))
        after = torch.rand(8)
    finally:
        torch.set_rng_state(state)
    return (a, b, after)


def generator_advances(got, ref) -> bool:
    return (isinstance(got, tuple) and len(got) == 3 and ids_of(got[0], ref[0]) and ids_of(got[1], ref[1])
            and not same(got[0], got[1]) and not same(ref[0], ref[1]) and exact(got[2], ref[2]))


def ids_equal(got, ref) -> bool:
    """Integer ids of ref's shape and values; any integer dtype (the notebook does not fix the ids' dtype)."""
    return ids_of(got, ref) and same(got, ref)


def shape_and_ids(got, ref) -> bool:
    return (isinstance(got, tuple) and len(got) == 2 and ids_equal(got[0], ref[0]) and exact(got[1], ref[1]))


def draw_shape(ns):
    """[1, V] logits give [1] ids: a batch of one stays a batch. One row keeps a single finite logit, so the id is
    fixed; a second draw from a spread-out row shows the shape again."""
    only = ns["sample"](torch.tensor([[-INF, -INF, 0.0, -INF]]), generator=torch.Generator().manual_seed(8))
    spread = ns["sample"](torch.tensor([[0.0, 1.0, 2.0, 0.5]]), temperature=0.9, top_k=3,
                          generator=torch.Generator().manual_seed(9))
    return (only, tuple(spread.shape))


def half_precision(ns):
    """bfloat16 logits (a model's output): probabilities computed and returned in float32, as the notebook says."""
    logits = (torch.randn(2, 12, generator=torch.Generator().manual_seed(6)) * 2).to(torch.bfloat16)
    probs = ns["sampling_probs"](logits, temperature=0.7, top_k=6)
    return (str(probs.dtype), probs)


def one_d_draws(ns):
    """[V] logits (one id per call), 40 calls in a row with one generator: seed 1 under global seed 0 (a), seed 2
    under global seed 0 (b), seed 1 again under global seed 1 (c); then the global RNG's next numbers after a seeded
    reset and a [V] draw that was given a generator. Judged outside: a != b, a == c, and those numbers are the
    reference's (a [V] draw, too, uses the generator and leaves the global RNG alone)."""
    flat = torch.zeros(64)
    state = torch.get_rng_state()

    def run(global_seed, seed):
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(seed)
        return torch.stack([ns["sample"](flat.clone(), generator=generator) for _ in range(40)])
    try:
        a, b, c = run(0, 1), run(0, 2), run(1, 1)
        torch.manual_seed(123)
        ns["sample"](flat.clone(), generator=torch.Generator().manual_seed(5))
        after = torch.rand(8)
    finally:
        torch.set_rng_state(state)
    return (a, b, c, after)


def one_d_decides(got, ref) -> bool:
    return (isinstance(got, tuple) and len(got) == 4 and isinstance(ref, tuple) and len(ref) == 4
            and seeds_decide(got[:3], ref[:3]) and exact(got[3], ref[3]))


ONE_D = torch.tensor([1.0, 0.2, 2.0, -0.5, 1.5, 0.0])  # T = 0.7, top-4, top-p 0.9 keep tokens 2, 4, 0
N_ONE_D = 4_000


def one_d_frequencies(ns):
    """[V] logits, one id per call, 4,000 calls with one generator at T = 0.7, top-k 4, top-p 0.9: the shape of the
    stacked ids and their frequencies, judged against the reference's (a [V] draw keeps the temperature and the
    filters: tokens 1, 3 and 5 must never come out)."""
    generator = torch.Generator().manual_seed(13)
    ids = torch.stack([ns["sample"](ONE_D.clone(), temperature=0.7, top_k=4, top_p=0.9, generator=generator)
                       for _ in range(N_ONE_D)])
    return (tuple(ids.shape), torch.bincount(ids.long().flatten(), minlength=len(ONE_D)).double() / N_ONE_D)


def one_d_greedy(ns):
    """T = 0 on [V] logits, 8 calls: 64 logits of 0 with one 0.5 in another place each time (at T = 1 that token
    comes out 2.5 % of the time). Each call's 0-d id, stacked; judged as integer ids equal to the reference's."""
    out = []
    for i in range(8):
        logits = torch.zeros(64)
        logits[7 * i + 3] = 0.5
        out.append(ns["sample"](logits, temperature=0, generator=torch.Generator().manual_seed(i)))
    return torch.stack(out)


def greedy_half(ns):
    """T = 0 on bfloat16 logits: the one-hot of each row's argmax, in float32 (the notebook: float32 whatever the
    logits' dtype). The dtype comes back as a string, judged outside."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 0.0, 3.5, -2.0]]).to(torch.bfloat16)
    probs = ns["sampling_probs"](logits, temperature=0)
    return (str(probs.dtype), probs)


def wide_top_p_one(ns):
    """p = 1 keeps every token, also in a real vocabulary (49152, SmolLM2's) whose running total rounds to 1 early."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(31)) * 4
    return torch.isfinite(ns["top_p_filter"](logits, 1.0))


# The course's own sampler: left out of the sandbox (course.grade.sandbox.course_tree).
ABSENT = ["course.engine.sampling"]

CHECKS = {
    "test_temperature": [
        Check("T = 1", call("apply_temperature", LOGITS, 1.0), exact, "hint: T = 1 leaves the logits alone"),
        Check("T = 0.5", call("apply_temperature", LOGITS, 0.5), close(1e-6),
              "hint: temperature divides the logits (it does not multiply them)"),
        Check("sharper below 1", temperature_order, close(1e-6), "hint: lower T must make the top token more likely"),
    ],
    "test_temperature_hidden": [
        Check("a batch", call("apply_temperature", torch.tensor([[1.0, -2.0, 0.0], [4.0, 4.0, -4.0]]), 4.0),
              close(1e-6), "hint: divide every row"),
        Check("T = 0", call("apply_temperature", LOGITS, 0), raises, "hint: temperature <= 0 must raise ValueError"),
        Check("T < 0", call("apply_temperature", LOGITS, -0.5), raises, "hint: temperature <= 0 must raise ValueError"),
        Check("leaves its input alone", input_after(lambda ns, x: ns["apply_temperature"](x, 0.5)), exact,
              f"hint: return new logits (logits / T, not /= or div_): {UNCHANGED}"),
    ],
    "test_top_k": [
        Check("k = 2", call("top_k_filter", LOGITS, 2), FILTERED, "hint: keep the k largest; the rest become -inf"),
        Check("k = V", call("top_k_filter", LOGITS, 5), FILTERED, "hint: k >= V keeps all"),
        Check("k > V", call("top_k_filter", LOGITS, 50), FILTERED, "hint: k >= V keeps all"),
        Check("per row", call("top_k_filter", ROWS, 2), FILTERED, "hint: work along the last axis, one row at a time"),
    ],
    "test_top_p": [
        Check(f"p = {p}", call("top_p_filter", torch.tensor([0.05, 0.5, 0.15, 0.3]).log(), p), FILTERED,
              "hint: sort descending and keep a token while the mass BEFORE it is < p")
        for p in (0.7, 0.9, 0.3, 1.0)
    ],
    "test_filters_hidden": [
        Check("top-k rows, k = 1", call("top_k_filter", torch.tensor([[0.2, 0.1, 0.7, 0.0], [-1.0, 2.0, 1.5, 3.0],
                                                                     [5.0, 1.0, 0.0, -1.0]]), 1), FILTERED,
              "hint: top-k works per row, on the last axis"),
        Check("top-k, k = V - 1", call("top_k_filter", ROWS, 3), FILTERED,
              "hint: k < V drops the V - k smallest, also when only one is left out"),
        Check("top-k ties", call("top_k_filter", TIES, 2), FILTERED,
              "hint: every token tied with the k-th largest logit stays in (ties can keep more than k)"),
        Check("top-p rows", call("top_p_filter", P_ROWS, 0.65), FILTERED,
              "hint: top-p keeps the token that crosses p, per row, in sorted order"),
        Check("top-p tiny p", call("top_p_filter", P_ROWS, 0.01), FILTERED, "hint: the top token stays"),
        Check("top-p with -inf", call("top_p_filter", torch.tensor([1.0, float("-inf"), 0.0, 2.0]), 0.99), FILTERED,
              "hint: -inf inputs stay filtered"),
        Check("k = 0", call("top_k_filter", ROWS, 0), raises, "hint: invalid k or p must raise ValueError"),
        Check("p = 0", call("top_p_filter", ROWS, 0.0), raises, "hint: invalid k or p must raise ValueError"),
        Check("p > 1", call("top_p_filter", ROWS, 1.5), raises, "hint: invalid k or p must raise ValueError"),
        Check("k < 0", call("top_k_filter", ROWS, -1), raises, "hint: k < 1 must raise ValueError"),
        Check("p < 0", call("top_p_filter", ROWS, -0.2), raises, "hint: p must be in (0, 1]: p <= 0 raises ValueError"),
        Check("p = 1 on a 49152-token vocabulary", wide_top_p_one, exact,
              "hint: p = 1 keeps every token (a float32 running total can reach 1 before the last token)"),
        Check("top-p: the running total lands exactly on p", kept_per_row(0.5), exact, NUCLEUS_FULL),
        Check("top-p: exactly on p = 0.25", kept_per_row(0.25), exact, NUCLEUS_FULL),
        Check("top-k leaves its input alone", input_after(lambda ns, x: ns["top_k_filter"](x, 2)), exact,
              f"hint: return a new tensor (masked_fill, not masked_fill_): {UNCHANGED}"),
        Check("top-p leaves its input alone", input_after(lambda ns, x: ns["top_p_filter"](x, 0.6)), exact,
              f"hint: return a new tensor (masked_fill, not masked_fill_): {UNCHANGED}"),
    ],
    "test_sampling_probs": [
        Check("T = 0.5, top-3", call("sampling_probs", LOGITS, temperature=0.5, top_k=3), close(1e-6),
              "hint: temperature first, then top-k, then top-p, then ONE softmax over the survivors"),
        Check("T = 0", call("sampling_probs", LOGITS, temperature=0), close(0.0, same_dtype=False),
              "hint: T = 0 is the one-hot distribution of the argmax"),
    ],
    "test_sample_frequencies": [
        Check("T = 0.8, top-p 0.95", draws(0, LOGITS, N, temperature=0.8, top_p=0.95), shape_and(frequencies(N)),
              "hint: sample must draw from sampling_probs; [B, V] logits give [B] ids"),
    ],
    "test_sampler_hidden": [
        Check("temperature before top-p", call("sampling_probs", torch.tensor([1.0, 0.0, -1.0, -3.0]),
                                               temperature=0.25, top_p=0.95), close(1e-6),
              "hint: apply the temperature before top-p"),
        Check("T = 0.01: nearly greedy, still finite", call("sampling_probs", LOGITS * 10, temperature=0.01),
              close(1e-6), "hint: near T = 0, logits / T are huge: take the softmax (it subtracts the maximum), "
                           "not exp() and a sum"),
        Check("T = 2, top-2", call("sampling_probs", torch.tensor([1.0, 0.0, -1.0, -3.0]), temperature=2.0, top_k=2),
              close(1e-6), "hint: temperature, then top-k, then renormalise the kept tokens"),
        Check("top-k, then top-p", call("sampling_probs", COMBINED, top_k=2, top_p=0.5), close(1e-6),
              "hint: top-k comes before top-p (top-p sees the renormalised top-k survivors)"),
        Check("top-k and top-p on a batch", call("sampling_probs", torch.stack([COMBINED, COMBINED.flip(0)]),
                                                 temperature=0.7, top_k=3, top_p=0.6), close(1e-6),
              "hint: top-k comes before top-p, per row"),
        Check("greedy rows", call("sample", torch.tensor([[0.0, 5.0, 1.0], [3.0, -1.0, 2.0]]), temperature=0),
              close(0.0, same_dtype=False), "hint: temperature 0 is argmax, per row"),
        Check("[V] gives one id", single, exact, "hint: [V] logits give a single id (a 0-d tensor)"),
        Check("seeded", repeat_draw, pair_equal, "hint: the same seed must give the same samples"),
        Check("the generator decides the draw", generator_decides, seeds_decide,
              "hint: draw with the generator you are given (generator=generator), not the global RNG, and never "
              "reseed it: other seeds must give other samples"),
        Check("one generator, two draws; the global RNG untouched", one_generator_twice, generator_advances,
              "hint: draw with the generator itself (its state moves on, so the next draw differs), never rebuild "
              "or reseed it, and leave the global RNG alone (no torch.manual_seed)"),
        Check("greedy on a batch, ties", call("sampling_probs", GREEDY_ROWS, temperature=0),
              close(0.0, same_dtype=False),
              "hint: T = 0 is the one-hot of each row's own argmax; on a tie, the lowest token id"),
        Check("[1, V] gives [1]", draw_shape, shape_and_ids,
              "hint: [B, V] logits give [B] integer ids, also when B = 1: [1], not a 0-d id"),
        Check("bfloat16 logits", half_precision, shape_and(close(1e-6)),
              "hint: compute the probabilities in float32 (logits.float()) and return float32, whatever the "
              "logits' dtype"),
        Check("sampling leaves its input alone",
              input_after(lambda ns, x: (ns["sampling_probs"](x, temperature=0.7, top_k=3, top_p=0.8),
                                         ns["sample"](x, temperature=0.7, top_k=3, top_p=0.8,
                                                      generator=torch.Generator().manual_seed(4)))), exact,
              f"hint: work on new tensors (logits.float() is the same tensor when it is float32 already): {UNCHANGED}"),
        Check("sampling at T = 1 leaves its input alone",
              input_after(lambda ns, x: (ns["sampling_probs"](x, temperature=1.0, top_k=3),
                                         ns["sampling_probs"](x, top_p=0.8),
                                         ns["sampling_probs"](x, top_k=2, top_p=0.9),
                                         ns["sample"](x, top_k=3, generator=torch.Generator().manual_seed(4)),
                                         ns["sample"](x, top_p=0.8, generator=torch.Generator().manual_seed(4)))),
              exact, f"hint: at T = 1 too, filter new tensors (masked_fill, not masked_fill_): {UNCHANGED}"),
        Check("greedy leaves its input alone",
              input_after(lambda ns, x: (ns["sampling_probs"](x, temperature=0),
                                         ns["sampling_probs"](x, temperature=0, top_k=2, top_p=0.5),
                                         ns["sample"](x, temperature=0))), exact,
              f"hint: T = 0 only reads the logits (argmax): {UNCHANGED}"),
        Check("greedy on bfloat16 logits", greedy_half, shape_and(close(0.0, same_dtype=False)),
              "hint: at T = 0 too, return float32 probabilities whatever the logits' dtype (.float() the one-hot)"),
        Check("[V] logits: the generator decides, the global RNG untouched", one_d_draws, one_d_decides,
              "hint: draw with the generator you are given for [V] logits too (generator=generator), never the "
              "global RNG"),
        Check("[V] logits: temperature, top-k and top-p", one_d_frequencies, shape_and(frequencies(N_ONE_D)),
              "hint: [V] logits give one id drawn from sampling_probs with the same temperature, top_k and top_p "
              "as a row of [B, V]"),
        Check("[V] logits at T = 0", one_d_greedy, ids_equal, "hint: at T = 0, [V] logits give their argmax"),
        Check("rows sample their own distribution",
              draws(5, torch.tensor([[0.0, 0.2, 0.4, 0.6, 0.8, 1.0], [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]]), N,
                    temperature=1.5, top_k=4), shape_and(frequencies(N)),
              "hint: each row samples its own distribution"),
    ],
}
