"""course.engine.device's CPU facts: one reader of /proc/cpuinfo for the kernel build and the bench."""
from pathlib import Path

import pytest

from course.engine import device

CPUINFO = """processor\t: 0
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile
processor\t: 1
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile
"""


@pytest.fixture
def cpuinfo(monkeypatch):
    def use(text):
        monkeypatch.setattr(device, "_cpuinfo", lambda: text)
    return use


def test_name_and_flags_come_from_the_first_cpu(cpuinfo):
    cpuinfo(CPUINFO)
    assert device.cpu_name() == "Example CPU 9000"
    assert device.cpu_flags() == {"fpu", "sse2", "avx512f", "avx512_bf16", "amx_tile"}
    assert "Example CPU 9000" in device.cpu_kind() and "avx512f" in device.cpu_kind()


def test_arm_features_line(cpuinfo):
    cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU implementer\t: 0x41\n")
    assert "bf16" in device.cpu_flags()


def test_no_cpuinfo_means_unknown_not_absent(cpuinfo):
    cpuinfo(None)  # not Linux
    assert device.cpu_flags() is None
    assert device.cpu_name()  # the platform module's answer


def test_a_different_cpu_is_a_different_kernel_build(cpuinfo):
    from course.engine import row_product

    cpuinfo(CPUINFO)
    one = row_product.build_dir()
    cpuinfo(CPUINFO.replace("avx512f ", ""))
    assert row_product.build_dir() != one


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="Linux only")
def test_this_machine():  # against the file itself, read here without the module's parser
    text = Path("/proc/cpuinfo").read_text()
    first = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), None)
    assert device.cpu_flags() == (frozenset(first.partition(":")[2].split()) if first else frozenset())
    if "model name" in text:
        assert device.cpu_name() in text
