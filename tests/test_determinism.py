"""The greedy-is-not-deterministic demo and the sampling lesson's experiments, on the tiny model and on numbers."""
import math

import pytest
import torch

from course.lessons.determinism import (alone_vs_batched, compare_logits,
                                       flip_rate_estimate, gaps_figure, gaps_text, greedy_gaps, near_tie, sum_orders)
from course.lessons.sampling_demos import entropy_grid, matching_top_p, nucleus_by_order


def test_sum_orders_disagree_but_stay_near_the_exact_sum():
    sums, exact = sum_orders(100_000, seed=0)
    assert len(set(sums.values())) > 1  # float addition is not associative
    for value in sums.values():
        assert abs(value - exact) < 1e-4 * math.sqrt(100_000)  # every order is still a good float32 sum
    with pytest.raises(ValueError, match="n must be >= 2"):
        sum_orders(1)


def test_compare_logits_counts_bits():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(10.0))  # one ULP up
    d = compare_logits(a, b, "x")
    assert d.n_differ == 1 and d.median_ulps == 1.0 and d.same_argmax
    assert d.max_abs_diff == pytest.approx(2.0 ** -22)  # the float32 spacing at 2.0
    assert "1 of 4 logits differ" in d.summary() and "same argmax: yes" in d.summary()
    same = compare_logits(a, a.clone())
    assert same.n_differ == 0 and same.max_abs_diff == 0 and same.median_ulps == 0
    with pytest.raises(ValueError, match="of one shape"):
        compare_logits(a, torch.zeros(3))


def test_right_padding_does_not_change_the_real_positions_beyond_rounding(tiny):
    ids = [5, 17, 99, 3, 42]
    others = [list(range(10, 30)), list(range(40, 52))]
    alone, batched = alone_vs_batched(tiny, ids, others, pad_id=0)
    torch.testing.assert_close(alone, batched, atol=1e-4, rtol=1e-4)  # same maths
    assert int(alone.argmax()) == int(batched.argmax())
    # the padding value is irrelevant: a different pad id gives bit-identical logits for this row
    _, batched_other_pad = alone_vs_batched(tiny, ids, others, pad_id=7)
    assert torch.equal(batched, batched_other_pad)
    with pytest.raises(ValueError):
        alone_vs_batched(tiny, ids, [], pad_id=0)


class ByteTok:
    eos_id = 2

    def token_text(self, i):
        return f"<{i}>"

    def decode(self, ids, skip_special=False):
        return " ".join(str(i) for i in ids)


def test_near_tie_flips_the_argmax_when_runs_differ(tiny):
    g = torch.Generator().manual_seed(0)
    alone = torch.randn(256, generator=g) * 3
    batched = alone + torch.randn(256, generator=g) * 1e-5  # the kind of noise a batch adds
    tie = near_tie(tiny, ByteTok(), [5, 6, 7], alone, batched, n_continue=3)
    assert tie.flipped
    assert tie.margin_alone == pytest.approx(-tie.margin_batched)  # halfway between the two gaps
    assert abs(tie.margin_alone) < 1e-4
    top = int(alone.argmax())
    picks = {tie.continuation_alone.split()[0], tie.continuation_batched.split()[0]}
    assert str(top) in picks and len(picks) == 2  # one run kept the top token, the other took the runner-up
    assert tie.text_a == f"<{top}>" and "alone" in str(tie) and "batched" in str(tie)
    same = near_tie(tiny, ByteTok(), [5, 6, 7], alone, alone.clone(), n_continue=3)  # bit-identical runs
    assert not same.flipped and same.margin_alone == same.margin_batched == 0
    assert same.continuation_alone == same.continuation_batched


def test_gaps_text_and_figure_follow_the_numbers():
    text = gaps_text([1e-6, 0.5, 1.0], 1e-5)
    assert "greedy steps                    3" in text and "within noise   1" in text
    assert "50,000× the noise" in gaps_text([0.5, 1.0], 1e-5)
    assert "× the noise" not in gaps_text([0.5, 1.0], 0.0)
    assert gaps_figure([0.0, 0.01, 0.5, 2.0], 0.0).axes[0].get_legend() is None  # log10(0) is never drawn
    assert gaps_figure([0.01, 0.5], 1e-6).axes[0].get_legend() is not None


def test_greedy_gaps_follow_the_greedy_path(tiny):
    from course.engine.generate import generate

    ids = [3, 9, 27, 81]
    gaps = greedy_gaps(tiny, ids, n_new=6)
    assert len(gaps) == 6 and all(g >= 0 for g in gaps)
    with torch.inference_mode():
        first = tiny(torch.tensor([ids]), last_only=True)[0].topk(2).values
    assert gaps[0] == pytest.approx(float(first[0] - first[1]), abs=1e-5)
    # the gap at step i is the one before the token greedy generate() picked at step i
    tokens = generate(tiny, ids, 6, temperature=0).tokens
    with torch.inference_mode():
        logits = tiny(torch.tensor([ids + tokens[:3]]), last_only=True)[0].topk(2).values
    assert gaps[3] == pytest.approx(float(logits[0] - logits[1]), abs=1e-4)


def test_flip_rate_estimate():
    gaps = [0.05, 0.5, 1.0, 2.0]
    assert flip_rate_estimate(gaps, 1e-5, window=0.1) == pytest.approx(0.25 / 0.1 * 1e-5)
    assert flip_rate_estimate([1.0, 2.0], 1e-5) > 0  # never claims zero from a small sample
    assert flip_rate_estimate(gaps, 0.0) == 0.0
    with pytest.raises(ValueError):
        flip_rate_estimate([], 1e-5)


def test_order_of_composition():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(500, generator=g) * 2
    temps = [0.3, 0.6, 1.0, 1.5, 2.0]
    sizes = nucleus_by_order(logits, temps, top_p=0.9)
    t_first, p_first = sizes["temperature then top-p"], sizes["top-p then temperature"]
    assert len(set(p_first)) == 1  # top-p first: the nucleus ignores temperature
    assert t_first == sorted(t_first) and t_first[0] < t_first[-1]  # temperature first: it grows with T
    assert t_first[2] == p_first[2]  # at T = 1 the two orders agree
    with pytest.raises(ValueError, match="temperatures"):
        nucleus_by_order(logits, [0.0, 1.0], 0.9)


def test_entropy_grid_and_matching_top_p():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 2
    temps, ps = [0.5, 1.0, 1.5], [0.1, 0.5, 0.9, 1.0]
    grid = entropy_grid(logits, temps, ps)
    assert grid.shape == (3, 4)
    assert torch.all(grid[1:] >= grid[:-1] - 1e-5) and torch.all(grid[:, 1:] >= grid[:, :-1] - 1e-5)
    p, bits_p, bits_t = matching_top_p(logits, 0.7, [i / 100 for i in range(1, 101)])
    assert 0 < p < 1 and abs(bits_p - bits_t) < 0.3
