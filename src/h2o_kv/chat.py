"""Multi-turn generation on one bounded cache: the chat API.

* :func:`continue_generation` - ``model.generate`` for the *new* tokens of a turn on a cache that already holds
  the conversation (Hugging Face's ``generate`` otherwise expects the full token history as ``input_ids``).
* :class:`ChatSession` - a conversation on one :class:`~h2o_kv.H2OCache` kept across turns: the model's chat
  template is applied turn by turn, so only each new turn is fed. With ``streaming=True`` (the default) keys are
  re-rotated at their place inside the cache (:mod:`h2o_kv.hf.rotary`), so a conversation of any length runs in
  bounded memory and never leaves the model's trained positions (StreamingLLM, arXiv:2309.17453; the H2O paper's
  streaming variant, arXiv:2306.14048).

The terminal loop of ``h2o-kv chat`` is :mod:`h2o_kv.chat_terminal`.
"""

from __future__ import annotations

import signal
import threading
import time
import warnings
from typing import Any, TextIO

import torch

from .hf import compat
from .hf.cache import H2OBudgetWarning, H2OCache

_SENTINEL_USER, _SENTINEL_REPLY = "\x00h2o-user\x00", "\x00h2o-reply\x00"


def continue_generation(
    model,
    cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    feed_last: bool = True,
    **kwargs,
):
    """``model.generate`` for ``input_ids`` (the new tokens only) after the tokens already held by ``cache``.

    Hugging Face's ``generate`` treats ``input_ids`` as the whole history and skips the part the cache has seen,
    so a turn's tokens alone would be dropped. This passes the cache position of the new tokens explicitly.
    ``generate`` also never feeds its last generated token back; with ``feed_last=True`` (default) this does it
    with one more decode step, so that afterwards the cache has seen every token of the returned ``sequences``
    and the next call again takes only the next turn's tokens.

    Args:
        model: a model prepared with :func:`h2o_kv.enable_h2o` (``h2o_kv.load_model`` does it).
        cache: the :class:`~h2o_kv.H2OCache` (or any HF cache) of the conversation so far; may be empty.
        input_ids: ``[batch, n]`` new tokens, ``n >= 1``: everything the cache has not seen. After an earlier
            ``continue_generation`` (``feed_last=True``) that is just the next turn; after a plain ``generate`` it
            also includes that call's last generated token, which ``generate`` returns but never feeds.
        attention_mask: ``[batch, n]`` for the new tokens (left padding), or ``[batch, seen + n]`` covering the
            whole history. Only needed for padded batches. The positions of the new tokens are ``seen + i`` (for
            padded earlier turns, pass the full history mask to keep them exact); a streaming cache ignores
            absolute positions altogether.
        feed_last: feed the last generated token into the cache before returning.
        **kwargs: anything ``model.generate`` accepts (``max_new_tokens``, ``do_sample``, ``streamer``, ...).

    Returns:
        What ``model.generate`` returns: ``sequences`` are ``input_ids`` followed by the generated tokens.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, n] with n >= 1 new tokens, got shape {tuple(input_ids.shape)}")
    batch, new = input_ids.shape
    seen = cache.get_seq_length() if cache is not None else 0
    if {"past_key_values", "cache", "cache_position"} & kwargs.keys():
        raise ValueError("continue_generation passes the cache and the positions itself")
    if attention_mask is not None and attention_mask.shape[1] not in (new, seen + new):
        raise ValueError(
            f"attention_mask must cover the {new} new tokens or the whole history ({seen + new}), "
            f"got length {attention_mask.shape[1]}"
        )
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones((batch, new), dtype=torch.long, device=device)
    if attention_mask.shape[1] == new and seen:  # generate wants the mask of the whole history
        attention_mask = torch.cat([attention_mask.new_ones((batch, seen)), attention_mask], dim=1)
    more = compat.continuation_kwargs(seen, new, device) if seen else {}
    output = model.generate(input_ids, attention_mask=attention_mask, **compat.cache_kwargs(cache), **more, **kwargs)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    if feed_last and cache is not None and sequences.shape[1] > new:
        done = cache.get_seq_length()
        with torch.no_grad():  # the token generate never fed back: now the cache has seen all of `sequences`
            model(sequences[:, -1:], **compat.cache_kwargs(cache), **compat.continuation_kwargs(done, 1, device))
    return output


class _Interrupt:
    """A flag set by Ctrl-C while a reply is generated; read by :class:`_StopOnFlag` after every token."""

    def __init__(self):
        self.event = threading.Event()

    def __enter__(self):
        self.event.clear()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, lambda *_: self.event.set())
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


class _StopOnFlag:
    """A ``StoppingCriteria`` that ends generation once ``event`` is set."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _PrintStreamer:
    """Writes the reply to ``out`` as it is generated (skips the prompt, decodes on word boundaries)."""

    def __init__(self, tokenizer, out: TextIO):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0
        self.skip_prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt:
            self.skip_prompt = False
            return
        self.ids.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.printed :])
        self.out.flush()


class ChatSession:
    """A conversation on one bounded :class:`~h2o_kv.H2OCache`, fed turn by turn.

    Each :meth:`send` feeds only the new turn (the chat template's closing of the previous reply, the user
    message and the assistant header) and generates the reply; earlier turns live only in the cache, evicted by
    the policy. Memory is bounded by ``heavy + recent`` entries per layer and KV head whatever the length.

    Args:
        model, tokenizer: from :func:`h2o_kv.load_model`; the tokenizer needs a chat template.
        heavy, recent: the cache budget in entries (must be >= 1 in total).
        policy: ``h2o`` (default), ``sink``, ``local`` or another bounded policy.
        streaming: re-rotate keys inside the cache (needs a RoPE model); without it the conversation must stay
            within ``config.max_position_embeddings`` tokens.
        system: an optional system prompt (else the template's default, if it has one).
        max_new_tokens, temperature, top_p: decoding (``temperature=0`` is greedy).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        heavy: int = 256,
        recent: int = 256,
        policy: str = "h2o",
        streaming: bool = True,
        system: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 0.9,
        **policy_options,
    ):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat needs a tokenizer with a chat template")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if policy == "full":
            raise ValueError("the chat needs a bounded policy (h2o, sink, local, ...), not 'full'")
        self.model, self.tokenizer = model, tokenizer
        self.cache_options = dict(heavy=heavy, recent=recent, policy=policy, streaming=streaming, **policy_options)
        self.cache = H2OCache(**self.cache_options)  # validates the budget and policy before any turn
        self.system = system
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self._closing, self._turn_template = self._template_pieces()
        self._interrupt = _Interrupt()
        self.reset()

    # -- template --------------------------------------------------------------------------------------------
    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if self.system is not None:
            messages = [{"role": "system", "content": self.system}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _template_pieces(self) -> tuple[str, str]:
        """The text that closes a reply, and the text of a later user turn (with the sentinel as message)."""
        first = [{"role": "user", "content": _SENTINEL_USER}, {"role": "assistant", "content": _SENTINEL_REPLY}]
        before = self._render(first, generation_prompt=False)
        after = self._render([*first, {"role": "user", "content": _SENTINEL_USER}], generation_prompt=True)
        if not after.startswith(before) or _SENTINEL_REPLY not in before:
            raise ValueError(
                "this chat template does not render a conversation incrementally; cannot chat turn by turn"
            )
        closing = before[before.index(_SENTINEL_REPLY) + len(_SENTINEL_REPLY) :]
        return closing, after[len(before) :]

    def turn_text(self, message: str) -> str:
        """The text fed for ``message``: the whole first prompt, or the closing of the last reply + a new turn."""
        if self.turns == 0:
            return self._render([{"role": "user", "content": message}], generation_prompt=True)
        closing = self._closing
        eos = self.tokenizer.eos_token
        if self._reply_closed and eos and closing.startswith(eos):  # the reply's own end-of-turn token is cached
            closing = closing[len(eos) :]
        return closing + self._turn_template.replace(_SENTINEL_USER, message)

    # -- conversation ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation (empty cache, same settings)."""
        self.cache = H2OCache(**self.cache_options)
        self.turns = 0
        self.generated = 0
        self._reply_closed = False

    def send(self, message: str, out: TextIO | None = None) -> dict[str, Any]:
        """Feed one user turn and generate the reply (printed to ``out`` as it comes, if given).

        Returns ``{"reply", "new_tokens", "prompt_tokens", "interrupted", "seconds"}``. Ctrl-C (SIGINT) while this
        runs in the main thread stops the reply after the current token; the session stays usable.
        """
        if not isinstance(message, str) or not message.strip():
            raise ValueError("empty message: type some text (or /quit)")
        ids = self.tokenizer(self.turn_text(message), add_special_tokens=False, return_tensors="pt").input_ids
        ids = ids.to(self.model.device)
        capacity = self.cache.policy.capacity
        # a turn longer than the window is fed token by token, so no position ever exceeds the window
        self.cache.stepwise = bool(self.context) and ids.shape[1] + capacity >= self.context
        streamer = _PrintStreamer(self.tokenizer, out) if out is not None else None
        eos = self.tokenizer.eos_token_id
        started = time.perf_counter()
        try:
            with self._interrupt, warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=H2OBudgetWarning)  # a chat's first turn is short
                warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
                sample = self.temperature > 0
                options = dict(temperature=self.temperature, top_p=self.top_p) if sample else {}
                output = continue_generation(
                    self.model, self.cache, ids, max_new_tokens=self.max_new_tokens, do_sample=sample,
                    streamer=streamer, stopping_criteria=[_StopOnFlag(self._interrupt.event)],
                    eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or eos, **options,
                )  # fmt: skip
        except Exception:
            self.reset()  # a failed forward may leave a half-updated cache behind
            raise
        finally:
            self.cache.stepwise = False
        reply_ids = output[0, ids.shape[1] :].tolist()
        self.turns += 1
        self.generated += len(reply_ids)
        self._reply_closed = bool(reply_ids) and reply_ids[-1] == eos
        return {
            "reply": self.tokenizer.decode(reply_ids, skip_special_tokens=True),
            "new_tokens": len(reply_ids),
            "prompt_tokens": int(ids.shape[1]),
            "interrupted": self._interrupt.event.is_set(),
            "seconds": time.perf_counter() - started,
        }

    def stats(self) -> dict[str, Any]:
        """The cache's :meth:`~h2o_kv.H2OCache.stats` plus the turn count and the streaming flag."""
        return {"turns": self.turns, "streaming": self.cache.streaming, **self.cache.stats()}

    def status_line(self, result: dict[str, Any] | None = None) -> str:
        s = self.stats()
        line = (
            f"[{s['policy']}{' streaming' if s['streaming'] else ''} | held {s['kv_tokens']} entries/layer "
            f"| seen {s['seen_tokens']} tokens | KV {_mib(s['kv_bytes'])} (full cache {_mib(s['full_kv_bytes'])})"
        )
        if result is not None and result["seconds"] > 0:
            line += f" | {result['new_tokens']} tokens in {result['seconds']:.1f}s"
            if result["interrupted"]:
                line += " | stopped"
        if not s["streaming"] and self.context and s["seen_tokens"] > self.context:
            line += f" | past the model's {self.context}-token context: positions are untrained (use streaming)"
        return line + "]"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
