"""Lesson 01 runs end to end (tests/notebook_runner.py: lesson_run); its recorded numbers tell the story, and
every verdict it prints (roofs, bf16, the held-out fit, the A/B answer) follows from those numbers."""
import math

import pytest

from course.paths import LESSONS
from learner_text import assert_learner_output_clean, check_run_time, flat, notebook_text
from test_bytes_line import check_printed

pytestmark = pytest.mark.slow
NOTEBOOK = LESSONS / "01_prefill_decode.ipynb"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from notebook_runner import lesson_run

    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=1500)


def test_lesson_measures_prefill_and_decode(run):
    r, _, _ = run
    # the streamed call: the first token waits for the whole prompt
    assert r["call_ttft_ms"] > r["call_itl_ms"] > 0
    # prefill processes tokens faster than decode produces them
    assert r["prefill_tokens_per_s_256"] > max(r["decode_tokens_per_s"])
    # a decode step reads the whole cache, so it slows as the context grows: by a few % at these contexts, which a
    # busy host's drift can hide in the medians (77.6 against 77.3 ms in one run), so the steps are compared round
    # by round: a longer context measurably faster (3 standard errors) would mean the cache is not read
    extra, se = r["decode_cache_extra_ms"], r["decode_cache_extra_se_ms"]
    assert extra > -3 * se, (extra, se)
    assert r["decode_contexts"] == sorted(r["decode_contexts"])
    assert r["decode_bound"] == "memory"
    # the checkpoint: output tokens dominate
    assert r["ab_slower"] == "B" and r["ab_B_total_s"] > r["ab_A_total_s"]
    assert r["ab_A_extrapolated"] and r["ab_B_extrapolated"]
    # the breakdown accounts for the step
    assert r["breakdown_n_matmuls"] == 7 * 30 + 1 and r["breakdown_n_ops"] > r["breakdown_n_matmuls"]
    assert r["breakdown_step_ms"] > r["breakdown_floor_ms"] * 0.5


def test_roofs_are_the_best_the_machine_showed(run):
    r, nb, _ = run
    # a roof is a limit: after raising each roof to the best point, no point beats its prediction
    for key in ("prefill_predicted_over_measured", "decode_predicted_over_measured"):
        for ratio in r[key]:
            assert math.isfinite(ratio) and 0.02 <= ratio <= 1 + 1e-9, (key, r[key])
    assert r["bandwidth_gb_s"] >= r["probe_bandwidth_gb_s"] and r["matmul_gflop_s"] >= r["probe_gflop_s"]
    text = flat(notebook_text(nb))
    for what, source in (("memory", r["bandwidth_source"]), ("matmul", r["flops_source"])):
        assert (f"{what} roof: the probe's" in text) == (source == "probe")
        if source != "probe":
            assert f"reached by {source}" in text


def cell_output(nb, marker: str) -> str:
    """The text a code cell printed, found by a piece of its source."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_bytes_line_section_prints_the_verdict_of_its_own_values(run):
    """The bytes line's cell, run as the lesson runs it (the default shapes), prints what its values say."""
    from course.measure import bytes_line as BL

    r, nb, _ = run
    line = BL.BytesLine.from_values(r["bytes_line"])
    check_printed(cell_output(nb, "line = bytes_line("), line)
    assert [p.name for p in line.points] == list(BL.default_shapes(line.device))
    from course.engine.device import pick_device
    assert line.device == pick_device("auto").type  # where the lesson's model runs, not always the CPU
    assert len(line.points) >= 3 and all(len(p.times_ms) >= 3 for p in line.points)
    assert line.wall_s < 600


def test_prose_follows_the_measurements(run):
    r, nb, _ = run
    text = flat(notebook_text(nb))
    # bf16: the verdict comes from the measured ratio and names the hardware found
    ratio = r["bfloat16_over_float32_decode"]
    assert f"measured {ratio:.2f}×" in text and r["bf16_hardware"] in text
    if ratio < 0.95:
        assert "bfloat16 decoded faster" in text
    elif ratio > 1.05:
        assert "bfloat16 was slower" in text
    # the held-out check says whether the fit holds, and the A/B answer widens its claim when it does not
    if r["heldout_holds"]:
        assert "the fit holds" in text
    else:
        assert "the fit does NOT hold" in text and "The fit missed its held-out run by" in text
    # the recap's clause on the cache follows the medians it quotes
    ms = r["decode_ms_per_token"]
    assert ("the cache adds a little per token" in text) == (ms[-1] > ms[0])
    assert ("timing noise hid the cache's small cost" in text) == (ms[-1] <= ms[0])
    # decode's intensity at short context vs long, printed from decode_cost
    assert "decode intensity:" in text and "at any context" not in text
    # the datacenter example is computed from published specs
    assert 6.0 <= r["dc_floor_ms"] <= 7.0 and 140 <= r["dc_ridge"] <= 170
    assert f"{r['dc_floor_ms']:.1f} ms per token at batch 1" in text


def test_runs_within_its_stated_time_with_a_recap_and_no_source_lesson_talk(run):
    r, nb, elapsed = run
    assert_learner_output_clean(nb, r, "01_prefill_decode")
    assert r["recap"]["next"] == "02_kv_cache.ipynb"
    check_run_time(NOTEBOOK, elapsed, nb)
