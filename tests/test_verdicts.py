"""Lesson 01's published figures and the signed wordings the lessons share (course.lessons.wording): each verdict
follows the numbers. (Lessons 02-05 test their own verdicts in their lesson tests.)"""
import pytest

from course.measure.published import datacenter_example


def test_datacenter_example_is_computed_from_published_specs():
    dc = datacenter_example("llama-2-7b", "a100")
    assert dc.weight_bytes == pytest.approx(13.5e9, rel=0.01)
    assert dc.floor_s * 1e3 == pytest.approx(dc.weight_bytes / 2.039e12 * 1e3)
    assert 150 < dc.gpu.ridge < 156 and "FlashAttention" in str(dc)
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'"):
        datacenter_example(gpu="tpu")


def test_signed_wordings_never_call_a_loss_a_saving():
    from course.lessons.wording import duration, lower_by, speedup_trend, times_faster

    assert lower_by(0.42, "TTFT") == "TTFT 42% lower"
    assert lower_by(-0.05, "TTFT") == "TTFT 5% higher, no saving in this run"
    assert "about the same" in lower_by(0.0, "TTFT") and "lower" not in lower_by(0.0, "TTFT")
    assert times_faster(2.5, "the cache") == "the cache is 2.50× faster"
    assert "SLOWER" in times_faster(0.8, "the cache") and "faster" not in times_faster(0.8, "the cache")
    assert speedup_trend([1, 2, 3]) == "kept growing with length"
    assert speedup_trend([3, 2, 1]) == "did NOT grow with length here"
    assert (duration(2.345), duration(0.0123), duration(0.0043), duration(0.00027)) == \
        ("2.35 s", "12 ms", "4.3 ms", "0.27 ms")
