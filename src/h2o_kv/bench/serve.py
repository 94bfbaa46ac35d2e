"""``h2o-kv bench serve``: serving throughput of KV settings at a fixed KV space, measured with vLLM's own tools.

For each setting, in a fresh server process (``h2o-kv serve``, i.e. vLLM's OpenAI server), the load comes from
vLLM's own load generator (``vllm bench serve`` over HTTP, its ``--save-result`` JSON with per-request details)
while a :class:`~h2o_kv.bench.monitor.Monitor` polls the server's ``/metrics`` (running requests, KV-cache usage)
and the RSS of its process tree. Each setting gets one result record; the invocation writes a markdown table and
a plot comparing them (:mod:`.serve_report`). Settings run one after another in the same invocation (the machine is
shared: compare the ratios of one invocation).

Workloads (:data:`WORKLOADS`; prompts are windows of the shared PG-19 books, fixed for a seed; every request ignores
EOS so all settings generate the same number of tokens):

* ``decode-heavy``: 1,024-token prompts, 1,024 output tokens;
* ``prompt-heavy``: 3,072-token prompts, 64 output tokens;
* ``chat``: multi-turn conversations (1 to 4 earlier exchanges of about 160 + 120 tokens, PG-19 passages as the
  turns) rendered with the model's chat template, 192 output tokens;
* ``decode-step``: 4,096-token prompts, 128 output tokens, sent together: the decode step at batch ``concurrency``
  is timed per step from the streamed token times, over the window where every request is decoding (no prefill
  overlaps it; see :func:`steady_step_ms`);
* ``xsum``: XSUM 0-shot summaries through the server's chat API (greedy, the file's ``max_tokens`` and stop),
  scored with ROUGE (:mod:`h2o_kv.eval.xsum`), paired against the first setting.

The KV space (``kv_cache_gb="auto"``, :func:`kv_space_bytes`): vLLM allocates KV memory in blocks of
``block_size`` tokens holding every layer's keys and values, ``2 * layers * kv_heads * head_dim * dtype bytes``
per token; one block of the pool is vLLM's reserved null block. ``auto`` gives exactly ``fit`` (default 4) blocks
of a full-length request of the workload, plus the null block: for the default model in fp32, 46,080 bytes per
token, 5,898,240 per 128-token block, and for decode-heavy (2,048 tokens = 16 blocks) 4 x 16 + 1 = 65 blocks =
383,385,600 bytes (0.357 GiB).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..harness import records
from ..harness.tables import mean, percentile
from ..vllm import heap
from ..vllm.config import ENV, ServeConfig
from ..vllm.serve import ServeOptions, ServerProcess, describe, vllm_cli, vllm_distribution
from .monitor import Monitor, scrape
from .serve_report import one_line

BLOCK_SIZE = 128  # vLLM's CPU default; passed to the server explicitly so the KV arithmetic holds


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: int  # prompt tokens (chat: tokens per user turn)
    output: int
    turns: int = 0  # chat: most earlier exchanges

    @property
    def longest(self) -> int:
        """Tokens of the longest request (prompt + output; chat: an estimate with the template's overhead)."""
        if self.turns:
            return (self.turns + 1) * (self.prompt + 16) + self.turns * (CHAT_REPLY + 16) + self.output
        return self.prompt + self.output


CHAT_REPLY = 120
WORKLOADS = {
    w.name: w
    for w in (
        Workload("decode-heavy", 1024, 1024),
        Workload("prompt-heavy", 3072, 64),
        Workload("chat", 160, 192, turns=4),
        Workload("decode-step", 4096, 128),
        Workload("xsum", 0, 64),
    )
}


@dataclass(frozen=True)
class Setting:
    """One server configuration: a :class:`ServeConfig` and its label (``full``, ``h2o@0.2``, ``h2o@256+256``)."""

    label: str
    config: ServeConfig

    @classmethod
    def parse(cls, text: str, default_budget: float | None = None) -> Setting:
        """``full``; ``POLICY`` (with ``default_budget``); ``POLICY@RATIO``; ``POLICY@HEAVY+RECENT``."""
        name, _, spec = text.strip().partition("@")
        if name == "full":
            if spec:
                raise ValueError(f"--policies: full takes no budget, got {text!r}")
            return cls("full", ServeConfig("full"))
        try:
            if not spec:
                if default_budget is None:
                    raise ValueError(f"--policies: {name} needs a budget: {name}@0.2, {name}@256+256 or --budget")
                return cls(f"{name}@{default_budget:g}", ServeConfig(name, budget=default_budget, min_entries=0))
            if "+" in spec:
                heavy, recent = (int(part) for part in spec.split("+", 1))
                return cls(f"{name}@{heavy}+{recent}", ServeConfig(name, heavy=heavy, recent=recent))
            # a ratio label is the paper's rule (no min_entries floor), as the transformers backend's
            return cls(f"{name}@{float(spec):g}", ServeConfig(name, budget=float(spec), min_entries=0))
        except ValueError as err:
            raise ValueError(f"--policies {text!r}: {err}") from None

    @property
    def file_label(self) -> str:
        return self.label.replace("@", "_").replace("+", "_")


def model_kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """KV bytes one token takes over all layers (keys and values), from the model's ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def kv_space_bytes(model_dir: Path, request_tokens: int, fit: int, block_size: int = BLOCK_SIZE) -> int:
    """KV bytes for exactly ``fit`` requests of ``request_tokens`` tokens at full length, plus vLLM's null block."""
    blocks = fit * math.ceil(request_tokens / block_size) + 1
    return blocks * block_size * model_kv_bytes_per_token(model_dir)


# -- prompts ------------------------------------------------------------------------------------------------------


def exact_text(tokenizer, ids: list[int], length: int) -> str:
    """Text whose tokenization has exactly ``length`` tokens, decoded from a prefix of ``ids`` (a few retries:
    decoding and re-encoding can merge or split tokens at the edges)."""
    take = length
    text = tokenizer.decode(ids[:take])
    for _ in range(16):
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if count == length:
            return text
        take += length - count
        text = tokenizer.decode(ids[:take])
    raise ValueError(f"could not cut a {length}-token text from the PG-19 windows")


def make_dataset(workload: Workload, tokenizer, count: int, seed: int) -> list[dict]:
    """``count`` requests ``{"prompt", "output_tokens"}`` of ``workload`` (deterministic for a seed)."""
    from .workload import make_prompts

    if workload.turns:
        return _chat_dataset(workload, tokenizer, count, seed)
    windows = make_prompts(tokenizer, count, workload.prompt + 64).tolist()
    random.Random(seed).shuffle(windows)
    return [{"prompt": exact_text(tokenizer, ids, workload.prompt), "output_tokens": workload.output}
            for ids in windows]  # fmt: skip


def _chat_dataset(workload: Workload, tokenizer, count: int, seed: int) -> list[dict]:
    from .workload import make_prompts

    rng = random.Random(seed)
    pieces = make_prompts(tokenizer, count * (2 * workload.turns + 1), workload.prompt + 32).tolist()
    rng.shuffle(pieces)
    rows = []
    for index in range(count):
        earlier = 1 + index % workload.turns
        messages = []
        for _ in range(earlier):
            user = exact_text(tokenizer, pieces.pop(), workload.prompt)
            reply = exact_text(tokenizer, pieces.pop(), CHAT_REPLY)
            messages += [{"role": "user", "content": "Read this and tell me what happens next:\n" + user},
                         {"role": "assistant", "content": reply}]  # fmt: skip
        messages.append(
            {"role": "user", "content": "And this one?\n" + exact_text(tokenizer, pieces.pop(), workload.prompt)}
        )
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rows.append({"prompt": prompt, "output_tokens": workload.output, "turns": earlier + 1})
    return rows


# -- measuring -----------------------------------------------------------------------------------------------------


def steady_step_ms(detail: dict) -> dict | None:
    """The decode step while every request decodes: the gaps between consecutive streamed tokens of all requests
    inside ``[last first-token time, first last-token time]`` (no prefill inside that window when the requests
    were sent together). ``None`` when the window holds no gap (requests did not overlap)."""
    starts, ttfts, itls = detail.get("start_times"), detail.get("ttfts"), detail.get("itls")
    if not starts or not ttfts or not itls:
        return None
    times = []
    for start, ttft, gaps in zip(starts, ttfts, itls, strict=True):
        if start is None or not ttft:
            continue
        t = [start + ttft]
        for gap in gaps:
            t.append(t[-1] + gap)
        times.append(t)
    if len(times) < 2:
        return None
    begin, end = max(t[0] for t in times), min(t[-1] for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:], strict=False) if a >= begin and b <= end]
    if len(gaps) < 4:
        return None
    ms = [1000 * gap for gap in gaps]
    return {"p50": percentile(ms, 50), "mean": sum(ms) / len(ms), "p99": percentile(ms, 99), "gaps": len(ms),
            "window_s": end - begin, "requests": len(times)}  # fmt: skip


def bench_serve_command(server: ServerProcess, dataset: Path, result_dir: Path, name: str, requests: int,
                        concurrency: int, seed: int) -> list[str]:  # fmt: skip
    """The ``vllm bench serve`` command line against ``server``."""
    return [
        *vllm_cli("bench serve"), "--backend", "vllm", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", server.model, "--tokenizer", str(server.model_dir), "--dataset-name", "custom",
        "--dataset-path", str(dataset), "--custom-output-len", "-1", "--skip-chat-template",
        "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip


def warm_up(server: ServerProcess, api_key: str | None) -> None:
    """One short request, so the first measured request does not pay the server's first-call costs."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=api_key or "none", max_retries=0)
    client.completions.create(model=server.model, prompt="Hello", max_tokens=4, temperature=0)


def engine_info(server: ServerProcess) -> dict:
    """The KV pool as the engine reports it (``vllm:cache_config_info``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            labels = family.samples[0].labels
            out = {key: labels.get(key) for key in ("block_size", "kv_cache_size_tokens", "kv_cache_memory_bytes",
                                                    "enable_prefix_caching", "kv_cache_max_concurrency")}  # fmt: skip
            if out["block_size"] and out["kv_cache_size_tokens"]:
                out["num_blocks"] = int(out["kv_cache_size_tokens"]) // int(out["block_size"])
            return out
    return {}


def summarize_bench(result: dict) -> dict:
    keys = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
            "max_concurrent_requests", "total_input_tokens", "total_output_tokens")  # fmt: skip
    out = {key: result.get(key) for key in keys}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p99"):
            key = f"{stat}_{metric}_ms"
            if key in result:
                out[key] = result[key]
    return out


@dataclass
class ServeBench:
    """One ``h2o-kv bench serve`` invocation."""

    settings: list[Setting]
    workload: Workload
    requests: int
    concurrency: int
    kv_cache_bytes: int | None  # None: computed (:func:`kv_space_bytes`, ``fit`` requests)
    out: Path
    fit: int = 4
    port: int = 8200
    seed: int = 0
    api_key: str | None = None
    log_dir: Path | None = None
    vllm_args: tuple[str, ...] = ()  # more vllm serve arguments for every setting (e.g. --data-parallel-size 2)
    progress: Any = print

    def paths(self, setting: Setting) -> Path:
        return self.out.with_name(f"{self.out.stem}_{setting.file_label}.json")

    def run(self) -> list[dict]:
        from ..models import load_tokenizer, model_dir

        directory = model_dir(None)
        tokenizer = load_tokenizer(None)
        if self.kv_cache_bytes is None:
            self.kv_cache_bytes = kv_space_bytes(directory, self.workload.longest, self.fit)
        work = Path(tempfile.mkdtemp(prefix="h2o-kv-bench-serve-"))
        self.log_dir = self.log_dir or work
        dataset = None
        if self.workload.name != "xsum":
            rows = make_dataset(self.workload, tokenizer, self.requests, self.seed)
            dataset = work / f"{self.workload.name}.jsonl"
            dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
        results = []
        for setting in self.settings:
            path = self.paths(setting)
            if path.is_file():
                self.progress(f"{setting.label}: {path} exists, kept (delete it to measure again)")
                results.append(json.loads(path.read_text()))
                continue
            results.append(self.run_setting(setting, dataset, work, path))
        return results

    def server_options(self, setting: Setting) -> ServeOptions:
        max_len = max(2048, 2 ** math.ceil(math.log2(self.workload.longest + 64)))
        if self.workload.name == "xsum":  # articles of any length the model takes (one of the first 200 > 2,048)
            max_len = 8192
        gb = self.kv_cache_bytes / 2**30  # a power-of-two scale: exact, so the bytes come back unchanged
        return ServeOptions(setting.config, port=self.port, api_key=self.api_key, kv_cache_gb=gb,
                            max_model_len=min(max_len, 8192),
                            extra=("--block-size", str(BLOCK_SIZE), *self.vllm_args))  # fmt: skip

    def run_setting(self, setting: Setting, dataset: Path | None, work: Path, path: Path) -> dict:
        options = self.server_options(setting)
        log = self.log_dir / f"server_{self.workload.name}_{setting.file_label}.log"
        self.progress(f"{setting.label}: starting the server (log {log})")
        t0 = time.monotonic()
        with ServerProcess(options, log=log) as server:
            startup_s = time.monotonic() - t0
            warm_up(server, self.api_key)
            info = engine_info(server)
            before = scrape(server.url + "/metrics")
            with Monitor(server.url, server.pid, interval=0.5) as monitor:
                if self.workload.name == "xsum":
                    measured = self.run_xsum(server)
                    command = None
                else:
                    name = f"{self.workload.name}_{setting.file_label}.json"
                    command = bench_serve_command(server, dataset, work, name, self.requests, self.concurrency,
                                                  self.seed)  # fmt: skip
                    env = dict(os.environ)
                    if self.api_key:
                        env["OPENAI_API_KEY"] = self.api_key
                    self.progress(f"{setting.label}: vllm bench serve, {self.requests} requests, concurrency "
                                  f"{self.concurrency}")  # fmt: skip
                    with open(log.with_suffix(".bench.log"), "w") as out:
                        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
                    if done.returncode != 0:
                        raise RuntimeError(f"vllm bench serve failed ({done.returncode}); see {out.name}")
                    measured = json.loads((work / name).read_text())
            after = scrape(server.url + "/metrics")
        busy = [row for row in monitor.samples if row.get("running", 0) > 0]
        fields: dict[str, Any] = {
            "setting": setting.label,
            "policy": setting.config.policy,
            "budget": setting.config.budget,
            "heavy": setting.config.heavy,
            "recent": setting.config.recent,
            "bounded": setting.config.evicts,
            "backend": "vllm",
            "workload": asdict(self.workload),
            "requests": self.requests,
            "concurrency": self.concurrency,
            "seed": self.seed,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_fit_requests": self.fit,
            "engine": info,
            "server_command": describe(server.argv, server.env),
            "server_env": {name: server.env.get(name) for name in (ENV, "VLLM_CPU_OMP_THREADS_BIND", *heap.ENV)},
            "vllm_args": list(self.vllm_args),
            "bench_command": command and " ".join(command),
            "startup_s": round(startup_s, 1),
            "max_running": monitor.peak("running"),
            "mean_running_while_busy": sum(r["running"] for r in busy) / len(busy) if busy else None,
            "max_waiting": monitor.peak("waiting"),
            "preemptions": after["preemptions"] - before["preemptions"],
            "peak_kv_usage": monitor.peak("kv_usage"),
            "peak_rss_bytes": monitor.peak("rss"),
            "timeline": monitor.timeline(),
            "loadavg_1m_end": os.getloadavg()[0],
        }
        if self.workload.name == "xsum":
            fields.update(measured)
        else:
            fields["metrics"] = summarize_bench(measured)
            fields["decode_step_ms"] = steady_step_ms(measured)
            fields["errors"] = [e for e in measured.get("errors", []) if e][:5]
            fields["input_lens"] = measured.get("input_lens")
        data = records.record("serve_bench", fields, h2o_cache=False)
        data["versions"].update(vllm_versions())
        records.save(path, data)
        self.progress(f"{setting.label}: {one_line(data)} -> {path}")
        return data

    def run_xsum(self, server: ServerProcess) -> dict:
        from ..eval.xsum import read_xsum, rouge_scores

        items = read_xsum()[: self.requests]
        predictions = asyncio.run(_xsum_requests(server, items, self.concurrency, self.api_key))
        rows = [rouge_scores(p, item["summary"]) for p, item in zip(predictions, items, strict=True)]
        metrics = {}
        for name in ("rouge1", "rouge2", "rougeL"):
            estimate = mean([row[name] for row in rows])
            metrics[name], metrics[f"{name}_stderr"] = estimate.value, estimate.se
        return {"metrics": metrics, "n": len(rows), "predictions": predictions,
                "items": {name: [row[name] for row in rows] for name in ("rouge1", "rouge2", "rougeL")},
                "xsum": "first N of xsum/xsum_0shot.jsonl; the article as one chat user turn; greedy; max_tokens and "
                        "stop from the file; ROUGE F-measure with the Porter stemmer"}  # fmt: skip


async def _xsum_requests(server: ServerProcess, items: list[dict], concurrency: int, api_key: str | None) -> list[str]:
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)

    async def one(item):
        async with gate:
            reply = await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": item["article"]}],
                max_tokens=item["max_tokens"], stop=item["stop"] or None, temperature=0.0,
            )  # fmt: skip
            return (reply.choices[0].message.content or "").strip()

    try:
        return list(await asyncio.gather(*(one(item) for item in items)))
    finally:
        await client.close()


def vllm_versions() -> dict[str, str]:
    from importlib import metadata

    name = vllm_distribution()
    return {name: metadata.version(name)} if name else {}
