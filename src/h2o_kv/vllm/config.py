"""The vLLM backend's settings: one server-wide :class:`ServeConfig`, optionally overridden per request.

``h2o-kv serve`` (or a test building ``vllm.LLM``) puts the server-wide setting into the environment variable
:data:`ENV` as JSON before vLLM starts; the plugin reads it in every vLLM process (API server, engine core, worker).
A request may override it through the OpenAI API's extra body, ``extra_body={"vllm_xargs": {"h2o_heavy": 64, ...}}``
(vLLM hands ``vllm_xargs`` to ``SamplingParams.extra_args``); the keys are :data:`REQUEST_KEYS`, and any other
``h2o_*`` key is refused. This module imports neither torch nor vLLM, so the CLI can check options at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

from ..budget import Budget
from ..registry import ACROSS_LAYERS, HEAD_ADAPTIVE, SERVER_POLICIES, parse_policy

ENV = "H2O_KV_VLLM"
REQUEST_KEYS = {"h2o_policy": "policy", "h2o_heavy": "heavy", "h2o_recent": "recent", "h2o_budget": "budget",
                "h2o_min_entries": "min_entries"}  # fmt: skip
# The server's floor under a ratio budget (:class:`~h2o_kv.budget.Budget`): a chat turn whose prompt and reply fit in
# 256 tokens runs exactly as the full cache (a 38-token prompt at budget 0.2 would keep 3 + 3 entries), the floor costs
# 11.25 MiB of KV per request on the default model, and from a 1,280-token prompt on a 0.2 ratio applies (the paper).
MIN_ENTRIES = 256


def model_refusal(text_config, architectures=()) -> str | None:
    """What a model's Hugging Face (text) config asks of attention that the H2O backend does not implement, as a
    phrase, or None: every layer must be full causal self-attention, plain softmax, no ALiBi bias. Read before
    serving by the plugin (vLLM's config) and by ``h2o-kv serve`` (transformers' ``AutoConfig``); the worker checks
    each layer as vLLM builds it, sinks included (:func:`h2o_kv.vllm.attention.check_layer`)."""

    def get(name, default=None):
        return getattr(text_config, name, default)

    layer_types = get("layer_types")  # where given, it says which layers slide
    other = sorted({kind for kind in layer_types or () if kind != "full_attention"})
    if other:
        return f"layer types {', '.join(other)} (full attention only)"
    if not layer_types and get("sliding_window") is not None and get("use_sliding_window", True):
        return f"sliding-window attention (sliding_window={get('sliding_window')})"
    if get("attn_logit_softcapping"):
        return f"logit soft-capping (attn_logit_softcapping={get('attn_logit_softcapping')})"
    attn = get("attn_config")
    alibi = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    alibi = alibi or get("alibi", False) or get("position_encoding_type", "") == "alibi"
    if alibi or "BloomForCausalLM" in architectures:  # vLLM's ModelConfig.uses_alibi reads the same fields
        return "ALiBi position biases"
    return None


@dataclass(frozen=True)
class ServeConfig:
    """A KV setting for the serving backend: a policy and its :class:`~h2o_kv.budget.Budget`.

    ``policy="full"`` needs no budget and never evicts (vLLM's own cache behaviour). A ratio ``budget`` is taken of
    each request's own prompt length (the paper's rule, :class:`~h2o_kv.budget.Budget`) with a floor of
    ``min_entries`` kept entries (None: :data:`MIN_ENTRIES`; 0: none).
    """

    policy: str = "h2o"
    heavy: int | None = None
    recent: int | None = None
    budget: float | None = None
    min_entries: int | None = None

    def __post_init__(self):
        choices = ", ".join(SERVER_POLICIES)
        name = str(self.policy).partition(":")[0].strip()
        if name in ACROSS_LAYERS:
            raise ValueError(
                f"policy {name} shares one budget across all layers, which the serving backend does not "
                f"support (the transformers backend does); use one of {choices}"
            )
        if name in HEAD_ADAPTIVE:  # Ada-KV (arXiv:2407.11550): the backend's selection is not per head
            raise ValueError(
                f"policy {name} gives each KV head its own budget (Ada-KV), which the serving backend does "
                f"not implement (the transformers backend does); use one of {choices}"
            )
        parse_policy(self.policy, SERVER_POLICIES)  # the name, and options such as a2sf:decay=0.95 in range
        if self.evicts:
            self.as_budget()  # raises ValueError naming the option

    @property
    def evicts(self) -> bool:
        return parse_policy(self.policy).name != "full"

    def as_budget(self) -> Budget:
        floor = MIN_ENTRIES if self.min_entries is None and self.budget is not None else self.min_entries
        return Budget.of(budget=self.budget, heavy=self.heavy, recent=self.recent, min_entries=floor)

    def describe(self) -> str:
        return "policy full" if not self.evicts else f"policy {self.policy}, {self.as_budget().describe()}"

    def split(self, prompt_length: int) -> tuple[int, int]:
        """``(heavy, recent)`` for a request whose prompt has ``prompt_length`` tokens."""
        return self.as_budget().split(prompt_length)

    def make_policy(self, prompt_length: int):
        """The :mod:`h2o_kv.policies` object ranking a request's entries (None for ``full``), budget split by
        its own prompt length. Imports torch."""
        if not self.evicts:
            return None
        from ..policies import make_policy

        return make_policy(self.policy, *self.split(prompt_length))

    def engine_args(self) -> dict[str, object]:
        """vLLM engine options this setting needs (``vllm.LLM(**...)``; ``h2o-kv serve`` passes them as flags).

        An evicting setting compacts each request's kept entries into its own blocks, which must never be shared:
        no prefix caching."""
        return {"enable_prefix_caching": False} if self.evicts else {}

    def to_env(self) -> str:
        return json.dumps({key: value for key, value in asdict(self).items() if value is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ServeConfig | None:
        """The server-wide setting, or None where :data:`ENV` is unset (the plugin then changes nothing)."""
        text = environ.get(ENV)
        if not text:
            return None
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{ENV} must be a JSON object of ServeConfig fields: {err}") from None
        keys = set(REQUEST_KEYS.values())
        if not isinstance(fields, dict) or set(fields) - keys:
            raise ValueError(f"{ENV} must be a JSON object with keys {', '.join(sorted(keys))}; got {text!r}")
        return cls(**fields)

    def override(self, extra_args: Mapping[str, object] | None) -> ServeConfig:
        """This setting with a request's ``vllm_xargs`` applied; ValueError names the key and its allowed range."""
        if not extra_args:
            return self
        unknown = [key for key in extra_args if str(key).startswith("h2o_") and key not in REQUEST_KEYS]
        if unknown:
            known = ", ".join(REQUEST_KEYS)
            raise ValueError(f"invalid vllm_xargs: unknown key {', '.join(unknown)}; the h2o-kv keys are {known}")
        fields = {REQUEST_KEYS[key]: value for key, value in extra_args.items() if key in REQUEST_KEYS}
        if not fields:
            return self
        if {"heavy", "recent"} & fields.keys():  # counts given: they replace a server-wide ratio, and vice versa
            fields.setdefault("budget", None)
            fields.setdefault("min_entries", None)
        elif "budget" in fields:
            fields.update(heavy=None, recent=None)
        try:
            return replace(self, **fields)
        except ValueError as err:  # the message names the field (policy, heavy, recent, budget) and its range
            given = ", ".join(key for key in extra_args if key in REQUEST_KEYS)
            raise ValueError(f"invalid vllm_xargs ({given}): {err}") from None


def request_config(extra_args) -> ServeConfig | None:
    """The setting of a request: the server-wide one with its ``vllm_xargs`` applied (None: no plugin setting).

    ValueError names the bad key; per-request eviction needs an evicting server setting (which turned prefix
    caching off)."""
    server = ServeConfig.from_env()
    if server is None:
        return None
    config = server.override(extra_args)
    if config.evicts and not server.evicts:
        raise ValueError(
            f"invalid vllm_xargs: this server runs policy 'full' (prefix caching on), so a request cannot ask for "
            f"policy {config.policy!r}; start it with an evicting policy"
        )
    return config
