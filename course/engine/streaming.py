"""Turn a stream of token ids into a stream of text, without printing half a UTF-8 character."""
from __future__ import annotations


class TokenStreamer:
    """Call with each new token id; writes the text that is complete so far.

    Byte-level BPE can split one character (an emoji, say) across tokens, so we decode the whole
    answer so far and write only the new, complete part. Special tokens (like <|im_end|>) are hidden.
    """

    def __init__(self, tokenizer, write=print):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = 0  # characters already written

    def __call__(self, token_id: int) -> None:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return
        if len(text) > self.shown:
            self.write(text[self.shown:])
            self.shown = len(text)

    def flush(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special=True)
        if len(text) > self.shown:
            self.write(text[self.shown:])
            self.shown = len(text)

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special=True)
