"""The ``h2o-kv eval`` options, declared once: typer options shared by the commands, the KV setting they describe,
and the parsing of a sweep kind's own options (strings as typed after ``h2o-kv eval sweep --kind K``). Imports no
torch (``--help`` answers at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..harness.peers import PRESSES
from ..harness.setting import DYNAMIC, PRESS_PREFIX, KVSetting, check_name
from ..registry import BOUNDED_POLICIES, options_help

MODEL = typer.Option(None, "--model", help="Model name or local directory (default: the embedded default model).")
DTYPE = typer.Option(None, "--dtype", help="float32 (CPU default), bfloat16, float16.")
DEVICE = typer.Option(None, "--device", help="cpu, cuda, cuda:N, mps (default: CUDA when available).")
POLICY = typer.Option(
    None,
    "--policy",
    metavar="POLICY",
    help=f"KV setting: {DYNAMIC} (the stock DynamicCache: the model as shipped), full (H2OCache without eviction) "
    f"or an h2o-kv policy: {', '.join(BOUNDED_POLICIES)}. {options_help()}  [default: h2o]",
)
BUDGET = typer.Option(
    None,
    "--budget",
    metavar="RATIO",
    help="Ratio in (0, 1] of the prompt length L: heavy = recent = max(1, floor(B * L / 2)).",
)
HEAVY = typer.Option(None, "--heavy", help="Heavy-hitter entries kept (with --recent), instead of --budget.")
RECENT = typer.Option(None, "--recent", help="Recent entries kept (with --heavy).")
PEER = typer.Option(
    None,
    "--peer",
    help=f"Run a kvpress press instead of a policy: {', '.join(PRESSES)}.",
)
RECONSTRUCT = typer.Option(
    None,
    "--reconstruct",
    help="Score the prompt's entries by a context-reconstruction pass (KVzip's request to repeat the context, "
    "arXiv:2505.23416) for the --policy: sum (H2O's statistic) or max (KVzip's) of the request's attention, as the "
    "policy's observation window; about twice the prefill cost.",
)
JSON = typer.Option(None, "--json", help="Write the result JSON here (resumable).")
SERVER = typer.Option(
    None,
    "--server",
    help="Run the items through a running server's OpenAI API instead (h2o-kv serve, e.g. http://127.0.0.1:8000): "
    "the same prompts, the setting as each request's vllm_xargs; no model loads here (only its tokenizer).",
)
API_KEY = typer.Option(None, "--api-key", help="The --server's API key.")
KV_BITS = typer.Option(
    None,
    "--kv-bits",
    help="Store the kept KV entries quantized: 8 or 4 bits, group 64 (H2OCache(kv_bits=...)); with --policy dynamic: "
    "transformers' QuantizedCache (quanto, 4-bit). Default: full precision.",
)


def kv_setting(
    policy: str | None = None,
    budget: float | None = None,
    heavy: int | None = None,
    recent: int | None = None,
    peer: str | None = None,
    kv_bits: int | None = None,
    reconstruct: str | None = None,
) -> KVSetting:
    """The KV setting of the command-line options: ``--policy`` (default ``h2o``) or ``--peer PRESS``; ``--kv-bits``."""
    if peer is not None:
        from ..harness.peers import check_press

        if policy is not None:
            raise ValueError(f"--peer {peer} replaces --policy; give one of them (got --policy {policy})")
        name = PRESS_PREFIX + check_press(peer)
    else:
        name = check_name("h2o" if policy is None else policy, "--policy", presses=False)
    if kv_bits is not None:
        from ..hf.quant import KV_BITS as allowed

        if kv_bits not in allowed:
            raise ValueError(f"--kv-bits must be one of {', '.join(map(str, allowed))}; got {kv_bits}")
    if reconstruct is not None:
        from ..hf.cache import STATISTICS

        if reconstruct not in STATISTICS:
            raise ValueError(f"--reconstruct must be one of {', '.join(STATISTICS)}; got {reconstruct!r}")
    if reconstruct and peer is not None:
        raise ValueError(f"--reconstruct scores the prompt for an h2o-kv --policy; --peer {peer} has its own scoring")
    setting = KVSetting.of(
        name, budget=budget, heavy=heavy, recent=recent, option="--policy", kv_bits=kv_bits, reconstruct=reconstruct
    )
    if kv_bits is not None:  # dynamic with kv_bits is transformers' quanto cache: its extra, before any work
        setting.require_extras("--policy/--kv-bits")
    return setting


def option_int(options: dict[str, Any], name: str, default: int | None = None) -> int | None:
    """A sweep kind's integer option (typed as a string), or ``default``."""
    value = options.get(name, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--{name.replace('_', '-')} must be an integer, got {value!r}") from None


def option_path(options: dict[str, Any], name: str) -> Path | None:
    """A sweep kind's file option, or ``None`` when absent (a bare ``--name`` flag is an error)."""
    value = options.get(name)
    if value is True:
        raise ValueError(f"--{name.replace('_', '-')} needs a value")
    return None if value is None else Path(value)


def check_options(kind: str, options: dict[str, Any], allowed: set[str]) -> None:
    """Raise ``ValueError`` naming any option the sweep kind does not take."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        names = ", ".join("--" + u.replace("_", "-") for u in unknown)
        takes = ", ".join("--" + a.replace("_", "-") for a in sorted(allowed))
        raise ValueError(f"--kind {kind} does not take {names}; it takes {takes}")
