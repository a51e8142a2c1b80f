"""The byte-level BPE tokenizer, rebuilt from GGUF metadata with Hugging Face `tokenizers`.

SmolLM2's GGUF says: model 'gpt2' (byte-level BPE), pre-tokenizer 'smollm' (digits split one
by one), control tokens (type 3) such as <|im_start|> = 1 and <|im_end|> = 2 (end of turn, EOS).
The chat template already opens with <|im_start|>, so no BOS is added.
"""
from __future__ import annotations

import json
import os
import zlib
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from course.engine.weights import (_field, cached_weights_path, check_model_path, default_gguf_path, open_gguf,
                                   write_atomically)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types for control tokens (<|im_end|>) and added ones


@dataclass
class ChatTokenizer:
    tokenizer: "tokenizers.Tokenizer"  # noqa: F821
    chat_template: str | None
    bos_id: int | None
    eos_id: int
    add_bos: bool

    @property
    def vocab_size(self):
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (for plots): bytes decoded, spaces and newlines made visible."""
        text = self.tokenizer.decode([int(token_id)], skip_special_tokens=False)
        return text.replace("\n", "\\n").replace(" ", "␣") if text.strip() != text or not text else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's GGUF has no chat template; encode the prompt text directly")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages,
                                                          add_generation_prompt=add_generation_prompt)

    def chat_ids(self, user: str, system: str | None = None) -> list[int]:
        """Token ids of one user turn wrapped in the chat template, ready for the assistant's answer."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.encode(self.apply_chat_template(messages), add_bos=False)


def tokenizer_from_gguf(reader) -> ChatTokenizer:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, this one is {kind!r}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama3", "llama-bpe"):
        llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    added = {kind: [AddedToken(t, special=kind == CONTROL, normalized=False)
                    for t, k in zip(tokens, types) if k == kind] for kind in (CONTROL, USER_DEFINED)}
    tok.add_special_tokens(added[CONTROL])
    tok.add_tokens(added[USER_DEFINED])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ChatTokenizer(tok, _field(reader, "tokenizer.chat_template"), None if bos is None else int(bos),
                         int(_field(reader, "tokenizer.ggml.eos_token_id")),
                         bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))


def load_tokenizer(path: str | os.PathLike | None = None, use_cache: bool = True) -> ChatTokenizer:
    """The tokenizer of a GGUF file; the first build is stored as JSON next to the cached weights, with a CRC-32 of
    its fields (the weight cache's check): a damaged or older copy is rebuilt from the GGUF."""
    from tokenizers import Tokenizer

    path = check_model_path(Path(path) if path is not None else default_gguf_path())
    cached = cached_weights_path(path).with_suffix(".tokenizer.json") if use_cache else None
    crc = lambda data: f"{zlib.crc32(json.dumps(data, sort_keys=True).encode()):08x}"  # noqa: E731
    if cached is not None and cached.exists():
        with suppress(Exception):  # damaged, or written by an older version of the course: rebuilt from the GGUF below
            stored = json.loads(cached.read_text())
            data = stored["data"]
            if stored["crc32"] == crc(data):
                return ChatTokenizer(Tokenizer.from_str(data["tokenizer"]), data["chat_template"], data["bos_id"],
                                     data["eos_id"], data["add_bos"])
        cached.unlink(missing_ok=True)
    tok = tokenizer_from_gguf(open_gguf(path))
    if cached is not None:
        data = {"tokenizer": tok.tokenizer.to_str(), "chat_template": tok.chat_template, "bos_id": tok.bos_id,
                "eos_id": tok.eos_id, "add_bos": tok.add_bos}
        with suppress(OSError):  # a read-only cache folder: load_weights has already said so; built from the GGUF
            write_atomically(cached, lambda tmp: Path(tmp).write_text(json.dumps({"crc32": crc(data), "data": data})))
    return tok
