"""The vLLM backend's settings: one server-wide :class:`ServeConfig`, optionally overridden per request.

``h2o-kv serve`` (or a test building ``vllm.LLM``) puts the server-wide setting into the environment variable
:data:`ENV` as JSON before vLLM starts; the plugin reads it in every vLLM process (API server, engine core, worker).
A request may override it through the OpenAI API's extra body, ``extra_body={"vllm_xargs": {"h2o_heavy": 64, ...}}``
(vLLM hands ``vllm_xargs`` to ``SamplingParams.extra_args``); the keys are :data:`REQUEST_KEYS`. This module imports
neither torch nor vLLM, so the CLI can check options at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

from ..budget import Budget

ENV = "H2O_KV_VLLM"
# the names registered in h2o_kv.policies.POLICIES but the across-layers ones (importing it imports torch)
POLICY_NAMES = (
    "h2o", "local", "sink", "full", "tova", "snapkv", "random", "h2o_mean",
    "a2sf", "keydiff", "window_h2o", "ada_h2o", "ada_snapkv", "ada_window_h2o",
)  # fmt: skip
# one budget over all layers needs every layer's scores of a prompt before any layer evicts: transformers backend only
ACROSS_LAYERS = ("global_h2o", "global_snapkv", "global_window_h2o")
REQUEST_KEYS = {"h2o_policy": "policy", "h2o_heavy": "heavy", "h2o_recent": "recent", "h2o_budget": "budget"}


@dataclass(frozen=True)
class ServeConfig:
    """A KV setting for the serving backend: a policy and its :class:`~h2o_kv.budget.Budget`.

    ``policy="full"`` needs no budget and never evicts (vLLM's own cache behaviour). A ratio ``budget`` is taken of
    each request's own prompt length (the paper's rule, :class:`~h2o_kv.budget.Budget`).
    """

    policy: str = "h2o"
    heavy: int | None = None
    recent: int | None = None
    budget: float | None = None

    def __post_init__(self):
        if self.policy in ACROSS_LAYERS:
            raise ValueError(
                f"policy {self.policy} shares one budget across all layers, which the serving backend does not "
                f"support (the transformers backend does); use one of {', '.join(POLICY_NAMES)}"
            )
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}; got {self.policy!r}")
        if self.policy != "full":
            self.as_budget()  # raises ValueError naming the option

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    def as_budget(self) -> Budget:
        return Budget.of(budget=self.budget, heavy=self.heavy, recent=self.recent)

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
        if not isinstance(fields, dict) or set(fields) - {"policy", "heavy", "recent", "budget"}:
            raise ValueError(f"{ENV} must be a JSON object with keys policy, heavy, recent, budget; got {text!r}")
        return cls(**fields)

    def override(self, extra_args: Mapping[str, object] | None) -> ServeConfig:
        """This setting with a request's ``vllm_xargs`` applied; ValueError names the key and its allowed range."""
        if not extra_args:
            return self
        fields = {REQUEST_KEYS[key]: value for key, value in extra_args.items() if key in REQUEST_KEYS}
        if not fields:
            return self
        if {"heavy", "recent"} & fields.keys():  # counts given: they replace a server-wide ratio, and vice versa
            fields.setdefault("budget", None)
        elif "budget" in fields:
            fields.update(heavy=None, recent=None)
        try:
            return replace(self, **fields)
        except ValueError as err:  # the message names the field (policy, heavy, recent, budget) and its range
            given = ", ".join(key for key in extra_args if key in REQUEST_KEYS)
            raise ValueError(f"invalid vllm_xargs ({given}): {err}") from None
