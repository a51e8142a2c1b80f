import pytest

from course.engine.config import PRESETS, ModelConfig

PUBLISHED = {  # parameter counts from the model cards / papers
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "mistral-7b": 7_241_732_096,
    "llama-3-8b": 8_030_261_248,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name,count", PUBLISHED.items())
def test_parameter_counts_match_published(name, count):
    assert ModelConfig.from_name(name).n_params == count


def test_presets_are_consistent():
    for cfg in PRESETS.values():
        assert cfg.n_heads % cfg.n_kv_heads == 0
        if cfg.arch == "llama":
            assert cfg.n_heads * cfg.head_dim == cfg.dim


def test_smollm2_preset_equals_gguf_metadata(real_model):
    loaded = real_model.config
    preset = ModelConfig.from_name("smollm2-135m")
    for field in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "dim", "ffn_dim", "vocab_size",
                  "max_seq_len", "rope_theta", "tie_embeddings"):
        assert getattr(loaded, field) == getattr(preset, field), field


@pytest.mark.parametrize("bad", [dict(n_kv_heads=5), dict(n_layers=0), dict(head_dim=-1), dict(n_heads=4.5)])
def test_bad_config_rejected(bad):
    with pytest.raises(ValueError):
        ModelConfig.from_name("tiny").with_(**bad)


def test_unknown_preset():
    with pytest.raises(ValueError, match="llama-2-7b"):
        ModelConfig.from_name("llama-9")
