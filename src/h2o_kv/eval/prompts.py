"""Prompt in, text out: the chat-template encoding and the greedy, stop-string-cut generation shared by the
lm-eval tasks (:mod:`.tasks`), XSUM (:mod:`.xsum`) and the needle test (:mod:`.needle`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import KVRunner, Session


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    """``content`` as one user turn in the tokenizer's chat template, followed by the assistant's generation prompt."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def generate_text(
    runner: KVRunner,
    tokenizer,
    ids: Sequence[int],
    max_new_tokens: int,
    *,
    until: Sequence[str] = (),
    eos_ids: Sequence[int] | None = None,
) -> tuple[str, Session]:
    """Greedy text after the prompt ``ids`` under the runner's KV setting, decoded without special tokens.

    Generation stops at an EOS id (default: the tokenizer's EOS token) or once the text holds one of the ``until``
    strings; the text is cut before the first of them. Returns the text and the runner's session.
    """
    if eos_ids is None:
        eos = tokenizer.eos_token_id
        eos_ids = [] if eos is None else [eos]
    stop = None
    if until:

        def stop(tokens: list[int]) -> bool:
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            return any(s in text for s in until)

    tokens, session = runner.generate(ids, max_new_tokens, eos_ids=eos_ids, stop=stop)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for s in until:
        text = text.split(s)[0]
    return text, session
