"""Chat prompts as the lessons and widgets use them: a user turn, optionally the start of the answer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """A user turn in the chat template, optionally followed by the start of the assistant's answer."""
    user: str
    answer_prefix: str = ""

    def ids(self, tokenizer) -> list[int]:
        prefix = tokenizer.encode(self.answer_prefix, add_bos=False) if self.answer_prefix else []
        return tokenizer.chat_ids(self.user) + prefix

    def text(self) -> str:
        return f"user: {self.user}\nassistant: {self.answer_prefix}"


PROMPTS: dict[str, Prompt] = {
    # one token dominates: the model is sure what comes next
    "factual": Prompt("What is the capital of France?", "The capital of France is"),
    # many continuations are fine: the distribution is flat
    "open-ended": Prompt("Tell me a story.", "Once upon a time, there was a"),
    # in between: a few strong candidates
    "cat name": Prompt("Suggest a name for my new cat.", "How about"),
    "poem": Prompt("Write a short poem about the sea."),
}
