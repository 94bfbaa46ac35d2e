"""Evaluation items through a running server's OpenAI API (``h2o-kv serve``, or any vLLM OpenAI server).

:class:`ServerRunner` stands in for :class:`~h2o_kv.eval.runner.KVRunner` where an evaluation generates greedy
text (RULER, the needle): the same prompt token ids go to ``/v1/completions``, greedy, and the KV setting travels
as the request's ``vllm_xargs`` (:data:`h2o_kv.vllm.config.REQUEST_KEYS`; the full cache is ``h2o_policy: full``),
so one evicting server scores every server-side setting on exactly the items of a transformers run. The ratio rule
is the paper's (``h2o_min_entries: 0``), as the transformers backend's. The whole prompt is compressed at once (a
server sees the question inside the prompt), so only the ``question_in_prompt`` protocol can run here.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..harness.setting import KVSetting


def check_protocol(protocol: str) -> None:
    """A server request compresses its whole prompt: only ``question_in_prompt`` can run through ``--server``."""
    if protocol != "question_in_prompt":
        raise ValueError(f"--protocol {protocol}: a server request compresses its whole prompt, question included; "
                         "use --protocol question_in_prompt with --server")  # fmt: skip


@dataclass
class ServerSession:
    """What a request kept: KV entries per layer and KV head after its prompt, by the budget rule the server runs."""

    context_length: int
    kept: int


def request_args(setting: KVSetting) -> dict[str, Any]:
    """The ``vllm_xargs`` of ``setting``; ValueError (one line, naming the option) for what a server cannot run."""
    from ..vllm.config import ServeConfig

    if setting.press is not None:
        raise ValueError(f"--peer {setting.press}: kvpress presses run in the transformers backend only, not --server")
    if setting.reconstruct:
        raise ValueError("--reconstruct: the reconstruction pass cannot run in a server request (--server); "
                         "it needs a second forward over the prompt before decoding")  # fmt: skip
    if setting.kv_bits is not None:
        raise ValueError("--kv-bits: the serving backend keeps fp32 entries only (--server)")
    if not setting.bounded:
        return {"h2o_policy": "full"}
    policy = setting.spec.label
    budget = setting.budget
    if budget.is_ratio:
        floor = budget.min_entries or 0
        args = {"h2o_policy": policy, "h2o_budget": budget.ratio, "h2o_min_entries": floor}
        ServeConfig(policy, budget=budget.ratio, min_entries=floor)  # the server's own refusals, before any request
    else:
        args = {"h2o_policy": policy, "h2o_heavy": budget.heavy, "h2o_recent": budget.recent}
        ServeConfig(policy, heavy=budget.heavy, recent=budget.recent)
    return args


class ServerRunner:
    """Greedy generation through ``url``'s OpenAI API under one KV setting (see the module docstring)."""

    def __init__(self, url: str, setting: KVSetting, *, api_key: str | None = None, timeout: float = 600.0):
        try:
            import openai
        except ImportError:
            raise ImportError("--server needs the official openai client: pip install 'h2o-kv[eval]'") from None

        self.setting = setting
        self.xargs = request_args(setting)
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0,
                                    timeout=timeout)  # fmt: skip
        try:
            served = self.client.models.list().data
        except openai.APIError as err:
            raise ValueError(f"--server {url}: no OpenAI-compatible server answers there ({err})") from None
        if not served:
            raise ValueError(f"--server {url}: the server lists no model")
        self.model = served[0].id
        self.max_model_len = getattr(served[0], "max_model_len", None)  # vLLM lists it; None: not checked here

    device = "server"  # the record's device: nothing ran in this process

    def describe(self) -> dict[str, Any]:
        """The record's ``server`` field: where the items ran, what served them and the per-request arguments."""
        return {"url": self.url, "model": self.model, "vllm": self._version(), "vllm_xargs": self.xargs}

    def _version(self) -> str | None:
        request = urllib.request.Request(self.url + "/version")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return json.loads(reply.read()).get("version")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        *,
        eos_ids: Sequence[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
        then: Sequence[int] = (),
    ) -> tuple[list[int], ServerSession]:
        """As :meth:`KVRunner.generate`: the server decodes up to ``max_new_tokens`` (stopping at the model's EOS);
        the tokens are then cut where ``KVRunner`` would have stopped (an ``eos_ids`` token or ``stop``)."""
        if len(then):
            check_protocol("question_after")
        reply = self.client.completions.create(
            model=self.model, prompt=list(ids), max_tokens=max_new_tokens, temperature=0,
            extra_body={"vllm_xargs": self.xargs, "return_token_ids": True, "skip_special_tokens": True},
        )  # fmt: skip
        choice = reply.choices[0]
        tokens = list((choice.model_extra or {}).get("token_ids") or [])
        if not tokens and reply.usage.completion_tokens:
            raise ValueError(f"--server {self.url}: the reply holds no token_ids (a vLLM server returns them)")
        for end, token in enumerate(tokens, start=1):
            if token in eos_ids or (stop is not None and stop(tokens[:end])):
                tokens = tokens[:end]
                break
        return tokens, ServerSession(len(ids), self.setting.entries(len(ids)))


def server_field(runner) -> dict[str, Any]:
    """``{"server": ...}`` where the items ran through a server (:meth:`ServerRunner.describe`), else ``{}``."""
    return {"server": runner.describe()} if isinstance(runner, ServerRunner) else {}
