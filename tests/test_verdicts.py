"""Lesson 01's published figures and the counted nouns the lessons share (course.lessons.wording).
(Lessons 02-05 test their own verdicts in their lesson tests.)"""
import pytest

from course.measure.published import datacenter_example


def test_datacenter_example_is_computed_from_published_specs():
    dc = datacenter_example("llama-2-7b", "a100")
    assert dc.weight_bytes == pytest.approx(13.5e9, rel=0.01)
    assert dc.floor_s * 1e3 == pytest.approx(dc.weight_bytes / 2.039e12 * 1e3)
    assert 150 < dc.gpu.ridge < 156 and "FlashAttention" in str(dc)
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'"):
        datacenter_example(gpu="tpu")


def test_counted_puts_the_noun_in_its_number():
    from course.lessons.wording import counted

    assert (counted(1, "token"), counted(0, "token"), counted(1024, "token")) == ("1 token", "0 tokens", "1,024 tokens")
    assert counted(2, "miss", "misses") == "2 misses"
