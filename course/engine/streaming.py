"""Turn a stream of token ids into a stream of text, without printing half a UTF-8 character."""
from __future__ import annotations

from typing import Callable


class TokenStreamer:
    """Call with each new token id; writes the text that is complete so far.

    Byte-level BPE can split one character (an emoji, say) across tokens, so we decode the whole
    answer so far and write only the new, complete part. Special tokens (like <|im_end|>) are hidden.
    """

    def __init__(self, tokenizer, write=print):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = 0  # characters already written

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special=True)

    def __call__(self, token_id: int | None = None) -> None:
        """Add a token (None: none, write what is left, e.g. at the end of the answer)."""
        if token_id is not None:
            self.ids.append(int(token_id))
        text = self.text
        if (token_id is None or not text.endswith("\ufffd")) and len(text) > self.shown:  # \ufffd: a part character
            self.write(text[self.shown:])
            self.shown = len(text)


def stream_answer(model, tokenizer, prompt, max_new_tokens: int = 48, *, write: Callable[[str], None] | None = None,
                  system: str | None = None, raw: bool = False, **sampling):
    """Prompt → text, streamed: the one place the course wires a question to the model and back.

    `prompt`: the user's text (wrapped in the chat template, with an optional system turn; raw=True sends the
    text as is) or a list of token ids. Writes the answer as it is produced (print by default) and stops at the
    tokenizer's end-of-turn token. `sampling`: generate()'s settings (temperature, top_k, top_p, seed; greedy by
    default). Returns the Generation, its clock and its text.
    """
    from course.engine.generate import generate

    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if raw else tokenizer.chat_ids(prompt, system=system)
    else:
        ids = list(prompt)
    streamer = TokenStreamer(tokenizer, write or (lambda text: print(text, end="", flush=True)))
    gen = generate(model, ids, max_new_tokens, eos_id=tokenizer.eos_id, on_token=streamer, **sampling)
    streamer()
    gen.text = streamer.text
    return gen
