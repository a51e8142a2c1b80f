"""Lesson 04: its helpers gate and report what they measured (fast, tiny model), and the lesson runs end to end
(slow): every timed section has one short headline, nothing flagged reaches the recap, the numbers make sense."""
from __future__ import annotations

import math

import nbformat
import pytest
import torch

from course.paths import LESSONS

NOTEBOOK = LESSONS / "04_speculative_prefix.ipynb"
TIMED = ("costs", "simulated", "sweep", "prefix")  # Report keys of the timed sections


# --------------------------------------------------------------------------------------------- fast

def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    last = "".join(c.source for c in nb.cells[-4:])
    assert 'checkpoint("04_speculative_prefix")' in last and 'self_assessment("04_speculative_prefix")' in last
    assert "checkpoint_quiz" not in "".join(c.source for c in nb.cells)  # that quiz covers lessons 1–3
    nxt = next(c.source for c in nb.cells if "## What to do next" in c.source)
    assert "speculative_generate(" not in nxt or "import speculative_generate" in nxt
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for word, anchor in (("residual stream", "Residual-stream"), ("teacher forcing", "Teacher-forcing"),
                         ("block table", "Block-table")):  # defined, with the glossary linked, where first used
        first = text.lower().index(word)
        assert f"glossary.ipynb#{anchor}" in text[first - 5: first + len(word) + 40], word
    # the takeaways are hand-written, just above the recap
    recap = next(i for i, c in enumerate(nb.cells) if "recap(" in c.source)
    assert "## What to take away" in nb.cells[recap - 1].source


def test_sampling_check_passes_exact_sampling_and_fails_biased_samplers():
    from course.engine.speculative import speculative_first_token
    from course.lessons.speculative import SamplingCheck

    V, n = 2000, 20_000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(V, generator=g, dtype=torch.float64), 0)  # a peaked target with a long tail
    q = torch.softmax(0.8 * p.log() + 1.5 * torch.randn(V, generator=g, dtype=torch.float64), 0)  # half agrees
    exact = SamplingCheck(p, q, speculative_first_token(p, q, n, generator=g), 0.0)
    assert exact.within_noise and 0.2 < exact.predicted_acceptance < 0.8
    assert "within exact sampling's noise" in exact.report().headline
    # 10 % of the draws straight from the draft: a bias of 0.1 · TV(p, q)
    mix = torch.where(torch.rand(n, generator=g, dtype=torch.float64) < 0.1,
                      torch.multinomial(q, n, replacement=True, generator=g),
                      torch.multinomial(p, n, replacement=True, generator=g))
    biased = SamplingCheck(p, q, mix, 0.0)
    assert not biased.within_noise and "OUTSIDE" in biased.report().headline
    # no residual: a rejected draft replaced by a fresh draw from p instead of one from max(0, p − q)
    x = torch.multinomial(q, n, replacement=True, generator=g)
    keep = torch.rand(n, generator=g, dtype=torch.float64) < (p[x] / q[x]).clamp(max=1)
    lazy = SamplingCheck(p, q, torch.where(keep, x, torch.multinomial(p, n, replacement=True, generator=g)), 0.0)
    assert not lazy.within_noise


def _costs(verify, draft=0.4):
    from course.lessons.speculative import Costs

    return Costs(target_step=1.0, verify=verify, draft_step=draft, draft_layers=8, draft_share=0.4)


def test_cost_gate_flags_a_pass_cheaper_than_one_step_and_a_step_under_its_floor():
    clean = _costs({1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4})
    assert not [r for r in clean.rules(floor_ms=500) if r] and clean.v(0) == 1.0 and clean.v(3) == pytest.approx(1.3)
    assert not [r for r in _costs({1: 1.1, 2: 1.6, 3: 1.3, 4: 1.4}).rules(floor_ms=500) if r]  # kernels differ
    broken = [r for r in _costs({1: 0.8, 2: 1.2, 3: 1.3, 4: 1.4}).rules(floor_ms=500) if r]
    assert broken == ["a pass over 2 tokens took 800.0 ms, less than one step at 1000.0 ms"]
    assert any("under its" in r for r in clean.rules(floor_ms=2000) if r)


def test_prediction_charges_a_pass_with_nothing_drafted_one_plain_step():
    from course.lessons.speculative import predicted_from_costs

    costs = _costs({1: 1.5, 2: 1.75, 3: 2.0, 4: 2.25})
    # prompt lookup, k = 2: 63 passes found no match (1 token each), 37 checked 2 drafts and kept none
    assert predicted_from_costs([0] * 63 + [2] * 37, 100, costs, 0.0) == pytest.approx(100 / (63 + 37 * 1.75))
    # a model draft pays its m draft steps per pass
    assert predicted_from_costs([2] * 10 + [1] * 2, 24, costs, 0.4) == pytest.approx(
        24 / (10 * (2 * 0.4 + 1.75) + 2 * (0.4 + 1.5)))


def test_the_simulated_draft_keeps_about_alpha_and_changes_no_token(tiny, one_thread):
    from course.engine.generate import generate
    from course.engine.speculative import speculative_generate
    from course.lessons.speculative import OracleDraft, speedup_sweep

    ids = list(range(10, 40))
    answer = generate(tiny, ids, 90).tokens
    for alpha in (0.0, 0.5, 1.0):
        draft = OracleDraft(answer, alpha, tiny.config.vocab_size, cost=0.1)
        out = speculative_generate(tiny, draft, ids, 90, k=4)
        assert out.tokens == answer  # greedy verification keeps the output exact whatever the draft proposes
        assert out.stats.agreement == pytest.approx(alpha, abs=0.15) and draft.passes == out.stats.proposed
    # the sweep charges the oracle's drafted tokens c plain steps each, and predicts from those charges
    row = speedup_sweep(tiny, {"t": ids}, [("t", OracleDraft(answer, 1.0, 256, cost=0.5), 4)], _costs(
        {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, draft=0.9), n_new=21, rounds=1)[0]
    assert row.identical and row.tokens_per_pass == 5 and row.predicted_speedup == pytest.approx(5 / (4 * 0.5 + 1))


def test_a_flagged_measurement_is_shown_as_busy_and_never_recorded(fresh_progress):
    from dataclasses import astuple

    from course.lessons.speculative import SweepRow, sweep_report, sweep_rules
    from course.measure import gates
    from course.measure.results import recorded

    rows = [SweepRow("copy task", "prompt lookup (1..3-gram)", 4, 0.9, 4.4, 2.0, 2.2, True),
            SweepRow("copy task", "shallow SmolLM2 (8/30 layers)", 2, 0.3, 1.3, 0.6, 0.55, True)]
    good = sweep_report(gates.measured(lambda: rows, sweep_rules, "the speculative timing"))
    assert "ran 2.00× plain decoding, within ±30%" in good.headline and len(good.headline.split()) <= 30
    assert recorded()["spec_speedup"] == 2.0 and "unreliable" not in recorded()
    # a run faster than its own tokens per pass allow: impossible, so measured again, then flagged
    noisy = [SweepRow("copy task", "prompt lookup (1..3-gram)", 4, 0.9, 1.5, 2.0, 1.4, True), rows[1]]
    run = gates.measured(lambda: noisy, sweep_rules, "the speculative timing")
    assert not run.ok and run.tries == 3
    bad = sweep_report(run)
    assert bad.headline.startswith("Not used") and "2.00" not in str(bad).split("How sure")[0]
    assert run.notice in bad.details and "spec_speedup" in recorded()["unreliable"]
    # pass costs that failed their own gate give no prediction at all, rather than one built on them
    blind = [SweepRow(*astuple(r)[:6], math.nan, True) for r in rows]
    report = sweep_report(gates.measured(lambda: blind, sweep_rules, "the speculative timing"))
    assert "with no prediction, as the pass costs were unreliable" in report.headline
    assert all(row[1] is None for row in report.rows)


def test_costs_and_simulation_reports_on_the_tiny_model(tiny, one_thread, fresh_progress):
    from course.engine.generate import generate
    from course.lessons.speculative import (OracleDraft, costs_report, measure_costs, simulated_report, speedup_sweep,
                                            sweep_rules)
    from course.measure import gates
    from course.measure.results import recorded

    costs = gates.measured(lambda: measure_costs(tiny, depth=1, context=16, rounds=3), lambda c: c.rules(1e-6),
                           "the pass costs")
    report = costs_report(costs, 1e-6)
    assert len(report.headline.split()) <= 30 and len(report.rows) == 6
    ids = list(range(10, 40))
    oracle = OracleDraft(generate(tiny, ids, 24).tokens, 0.8, 256, cost=0.1)
    sim = gates.measured(lambda: speedup_sweep(tiny, {"t": ids}, [("t", oracle, 4)], costs.value, n_new=24, rounds=1),
                         sweep_rules, "the simulated speedup")
    shown = simulated_report(sim, oracle, costs.value)
    assert "Simulated" in str(shown) and len(shown.headline.split()) <= 30
    assert set(recorded()["headlines"]) >= {"costs", "simulated"}


# --------------------------------------------------------------------------------------------- slow

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from notebook_runner import lesson_run

    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=1200, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def results(run):
    return run[0]


@pytest.mark.slow
def test_reads_cleanly_within_its_stated_time(run):
    from learner_text import check_run_time, check_timed_lesson

    results, nb, elapsed = run
    check_timed_lesson(nb, results, TIMED)
    assert results["recap"]["next"] == "05_serving.ipynb"
    check_run_time(NOTEBOOK, elapsed, nb)


@pytest.mark.slow
def test_exactness(results):
    assert all(results["greedy_identical"].values()) and len(results["greedy_identical"]) == 2
    assert results["spec_within_noise"] is True
    assert results["spec_tv_distance"] <= results["spec_tv_noise_limit"] < results["spec_tv_draft"] / 3
    assert abs(results["spec_accepted_share"] - results["spec_predicted_acceptance"]) < 0.05


@pytest.mark.slow
def test_the_numbers_make_sense(results):
    assert results["acceptance_rate"] > 0.7  # the copy task's answer copies its prompt: lookup guesses right
    assert results["shallow_acceptance_rate"] < 0.5  # an early exit rarely agrees with the full model
    for r in results.get("sweep", []):  # gated: present only when no run beat its own tokens per pass
        assert r["identical"] and 1.0 <= r["tokens_per_pass"] <= r["k"] + 1 and r["speedup"] > 0
        assert r["speedup"] <= 1.1 * r["tokens_per_pass"]
    if "draft_cost_ratio" in results:
        assert 0 < results["draft_cost_ratio"] < 1.5 and results["verify_ratio"]["4"] >= 0.9
    assert results["prefix_identical"] and results["prefix_misses"] == 1 and results["prefix_token_share"] > 0.9
    if "prefix_prefill_saved" in results:
        assert results["prefix_prefill_saved"] > 0.3
