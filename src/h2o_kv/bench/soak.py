"""``h2o-kv bench soak``: a bounded load-and-fault run against a local vLLM server (``h2o-kv serve``).

For ``duration`` seconds, ``clients`` concurrent streaming clients (the official ``openai`` async client) send chat
completions one after another; a fifth of the clients (``disconnect_fraction``) close each stream after a random
number of chunks. Every request gets a client-side id (``user`` field) and ends in exactly one outcome: ``completed``
(a finish reason arrived), ``disconnected`` (we closed it) or ``error`` (an HTTP status and message). Checked:

* the server keeps serving (health, and a fresh request after the run);
* every request has one outcome with a clear error where it failed, response ids are unique, the API server counted
  exactly the requests the clients sent (``http_requests_total``: none lost, none duplicated; the client never
  retries) and the engine finished every completed one once (``vllm:request_success_total``);
* the resident memory of each server process (API server, engine core, each worker; sampled every second) after
  the warm-up stays within 5% (or 8 MiB) of its level at the end of the warm-up;
* the KV cache drains: running requests and KV-cache usage return to 0 after the run;
* bad requests (a prompt longer than the context, negative or huge ``max_tokens``, malformed JSON, an invalid
  per-request H2O setting) each get a 4xx with a message, and the server still answers afterwards;
* the API key is enforced (401 without it or with a wrong one); the server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from dataclasses import asdict, dataclass

from .monitor import Monitor, scrape, tree_rss

RSS_TOLERANCE = 0.05
RSS_NOISE = 8 * 2**20  # bytes: a helper process of ~12 MB (multiprocessing's resource tracker) moves by pages


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 64
    duration_s: float = 300.0
    disconnect_fraction: float = 0.2
    max_tokens: tuple[int, int] = (16, 128)  # each request draws its max_tokens in this range
    warmup_fraction: float = 0.2  # RSS is compared from the end of this part of the run on
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.clients, int) and self.clients >= 1):
            raise ValueError(f"--clients must be an integer >= 1, got {self.clients!r}")
        if not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s!r}")
        if not 0 <= self.disconnect_fraction <= 1:
            raise ValueError(f"--disconnect-fraction must be in [0, 1], got {self.disconnect_fraction!r}")
        low, high = self.max_tokens
        if not 1 <= low <= high:
            raise ValueError(f"--max-tokens range must satisfy 1 <= low <= high, got {self.max_tokens!r}")


def server_counts(base_url: str) -> dict[str, float]:
    """What the server counted: chat-completion HTTP requests by status class (the API server's
    ``http_requests_total``) and requests the engine finished (``vllm:request_success_total``; a request aborted
    because its client left is not counted there)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {"http_2xx": 0.0, "http_4xx": 0.0, "http_5xx": 0.0, "engine_finished": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                out["engine_finished"] += sample.value
            elif sample.name == "http_requests_total" and sample.labels.get("handler") == "/v1/chat/completions":
                key = f"http_{sample.labels.get('status', '')}"
                if key in out:
                    out[key] += sample.value
    return out


def soak_prompts(count: int, seed: int) -> list[str]:
    """Short chat prompts: sentences of the shared PG-19 books (deterministic for a seed)."""
    from .workload import pg19_text

    words = pg19_text().split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        start = rng.randrange(0, len(words) - 120)
        prompts.append("Continue this passage: " + " ".join(words[start : start + rng.randint(20, 100)]))
    return prompts


async def _client(index: int, client, model: str, cfg: SoakConfig, end: float, prompts, outcomes, rng) -> None:
    import openai

    disconnects = index < round(cfg.clients * cfg.disconnect_fraction)
    number = 0
    while time.monotonic() < end:
        key = f"c{index}-r{number}"
        number += 1
        max_tokens = rng.randint(*cfg.max_tokens)
        cut = rng.randint(1, max_tokens) if disconnects else None
        row = {"key": key, "client": index, "max_tokens": max_tokens, "cut_after": cut, "chunks": 0, "id": None}
        start = time.monotonic()
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": rng.choice(prompts)}], max_tokens=max_tokens,
                temperature=0.0, stream=True, stream_options={"include_usage": True}, user=key,
            )  # fmt: skip
            finish, usage = None, None
            async for chunk in stream:
                row["id"] = row["id"] or chunk.id
                if chunk.choices:
                    row["chunks"] += 1
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                if cut is not None and row["chunks"] >= cut:
                    await stream.close()  # the client goes away mid-stream: the server must abort the request
                    break
            if cut is not None and row["chunks"] >= cut and finish is None:
                row["outcome"] = "disconnected"
            elif finish is not None:
                row.update(outcome="completed", finish_reason=finish, completion_tokens=usage)
            else:
                row.update(outcome="error", error="stream ended without a finish reason")
        except openai.APIStatusError as err:
            row.update(outcome="error", status=err.status_code, error=str(err.message)[:300])
        except (openai.APIError, OSError, asyncio.TimeoutError) as err:
            row.update(outcome="error", status=None, error=f"{type(err).__name__}: {err}"[:300])
        row["seconds"] = round(time.monotonic() - start, 3)
        outcomes.append(row)


async def _load(base_url: str, model: str, api_key: str | None, cfg: SoakConfig, prompts) -> list[dict]:
    import httpx
    import openai

    # idle connections expire before uvicorn's 5 s keep-alive timeout closes them (else a reused connection can be
    # closed by the server just as a request is sent on it: a client-side connection error)
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8,
                          keepalive_expiry=2.0)  # fmt: skip
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0))
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "none", http_client=http,
                                max_retries=0)  # fmt: skip
    outcomes: list[dict] = []
    end = time.monotonic() + cfg.duration_s
    rngs = [random.Random(cfg.seed * 1000 + i) for i in range(cfg.clients)]
    try:
        await asyncio.gather(*(_client(i, client, model, cfg, end, prompts, outcomes, rngs[i])
                               for i in range(cfg.clients)))  # fmt: skip
    finally:
        await client.close()
    return outcomes


def _post(url: str, body: bytes, api_key: str | None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def _message(text: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text[:300]
    error = data.get("error", data) if isinstance(data, dict) else data
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


def healthy(base_url: str, model: str, api_key: str | None) -> bool:
    """``/health`` answers 200 and a two-token completion succeeds."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=30) as response:
            if response.status != 200:
                return False
    except OSError:
        return False
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    status, _ = _post(base_url + "/v1/completions", body, api_key)
    return status == 200


def bad_requests(base_url: str, model: str, api_key: str | None, context: int, h2o_active: bool) -> list[dict]:
    """Each bad request's status and message, and whether the server was healthy right after it. The per-request
    H2O settings are checked only where the plugin is active (``h2o_active``: an evicting server setting); vLLM's
    own cache ignores ``vllm_xargs`` it does not know."""
    chat = base_url + "/v1/chat/completions"

    def body(**fields) -> bytes:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], **fields}).encode()

    cases = [
        ("prompt longer than the context", json.dumps({"model": model, "prompt": "word " * (context + 16),
                                                       "max_tokens": 4}).encode(), base_url + "/v1/completions"),
        ("negative max_tokens", body(max_tokens=-5), chat),
        ("huge max_tokens", body(max_tokens=10**9), chat),
        ("malformed JSON", b'{"model": "' + model.encode() + b'", "messages": [', chat),
        ("invalid per-request H2O setting (h2o_heavy=-3)", body(max_tokens=4, vllm_xargs={"h2o_heavy": -3}), chat),
        ("invalid per-request H2O setting (h2o_budget=2.5)", body(max_tokens=4, vllm_xargs={"h2o_budget": 2.5}), chat),
    ]  # fmt: skip
    rows = []
    for name, payload, url in cases:
        status, text = _post(url, payload, api_key)
        row = {
            "case": name,
            "status": status,
            "message": _message(text),
            "healthy_after": healthy(base_url, model, api_key),
        }
        row["ok"] = 400 <= status < 500 and bool(row["message"].strip()) and row["healthy_after"]
        if name.startswith("invalid per-request") and not h2o_active:
            row["ok"], row["note"] = None, "not applicable: the server runs vLLM's own cache (no H2O plugin active)"
        rows.append(row)
    return rows


def auth_checks(base_url: str, model: str, api_key: str | None) -> dict:
    """Status codes of a request without the key, with a wrong one and with the right one."""
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
    url = base_url + "/v1/completions"
    out = {"no_key": _post(url, body, None)[0], "right_key": _post(url, body, api_key)[0]}
    if api_key:
        out["wrong_key"] = _post(url, body, api_key + "-wrong")[0]
    out["ok"] = (out["no_key"] == 401 and out.get("wrong_key") == 401 and out["right_key"] == 200) if api_key else None
    return out


class ProcessMonitor(Monitor):
    """A :class:`~.monitor.Monitor` that also samples each process's RSS (``by_process``: :func:`rss_by_process`)."""

    def sample(self) -> dict:
        row = super().sample()
        row["by_process"] = rss_by_process(self.pid)
        return row


def rss_flatness(samples: list[dict], start: float, end: float) -> dict[str, dict]:
    """Per process: RSS at ``start`` (the end of the warm-up), its range up to ``end`` and the largest deviation
    from the level at ``start`` as a fraction (``flat``: within :data:`RSS_TOLERANCE`, or :data:`RSS_NOISE` bytes)."""
    window = [row for row in samples if start <= row["t"] <= end and row.get("by_process")]
    out = {}
    for name in window[0]["by_process"] if window else ():
        values = [row["by_process"][name] for row in window if name in row["by_process"]]
        level = values[0]
        change = max(abs(v - level) for v in values)
        deviation = change / level if level else None
        flat = change <= RSS_NOISE or (deviation is not None and deviation <= RSS_TOLERANCE)
        out[name] = {"at_warmup_end": level, "min": min(values), "max": max(values), "final": values[-1],
                     "max_deviation": deviation, "flat": flat}  # fmt: skip
    return out


def rss_by_process(pid: int) -> dict[str, int]:
    """RSS of each process of the server's tree, by ``name pid`` (which process grew)."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            out[f"{process.name()} {process.pid}"] = process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def listen_addresses(pid: int, port: int) -> list[str]:
    """The addresses the server's process tree listens on at ``port``."""
    import psutil

    root = psutil.Process(pid)
    found = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    found.add(conn.laddr.ip)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sorted(found)


def drain(base_url: str, timeout: float = 120) -> dict:
    """Wait until no request runs or waits and the KV-cache usage is 0; the last sample and the seconds it took."""
    start = time.monotonic()
    last = {}
    while time.monotonic() - start < timeout:
        last = scrape(base_url + "/metrics")
        if last["running"] == 0 and last["waiting"] == 0 and last["kv_usage"] == 0:
            break
        time.sleep(0.5)
    return {**last, "seconds": round(time.monotonic() - start, 1)}


def check_outcomes(outcomes: list[dict], counted: dict[str, float]) -> dict:
    """The request-accounting checks: one outcome per request, unique response ids, errors with a message, and the
    server's own counts (``counted``: :func:`server_counts` differences over the run) equal to the client's."""
    keys = [row["key"] for row in outcomes]
    ids = [row["id"] for row in outcomes if row["id"]]
    counts = {name: sum(row["outcome"] == name for row in outcomes) for name in ("completed", "disconnected", "error")}
    errors = [row for row in outcomes if row["outcome"] == "error"]
    too_long = [row["key"] for row in outcomes if (row.get("completion_tokens") or 0) > row["max_tokens"]]
    status_errors = sum(row.get("status") is not None for row in errors)
    aborted = counts["completed"] + counts["disconnected"] - counted["engine_finished"]
    return {
        "requests": len(outcomes),
        **counts,
        "server_counted": counted,
        "aborted_in_engine": aborted,
        "unique_keys": len(set(keys)) == len(keys),
        "unique_response_ids": len(set(ids)) == len(ids),
        "errors_have_message": all(row.get("error") for row in errors),
        "error_samples": errors[:5],
        "completions_within_max_tokens": not too_long,
        # The API server answered every request that reached it exactly once (200 for a stream, 4xx/5xx for an
        # error; the client never retries); a connection error never reached it. The engine finished every
        # completed request once; a disconnected one either was aborted or had finished before the abort arrived.
        "none_lost_or_duplicated": (
            counted["http_2xx"] == counts["completed"] + counts["disconnected"]
            and counted["http_4xx"] + counted["http_5xx"] == status_errors
            and counts["completed"] <= counted["engine_finished"] <= counts["completed"] + counts["disconnected"]
        ),
    }


def run_soak(server, cfg: SoakConfig, *, api_key: str | None, context: int, h2o_active: bool,
             progress=print) -> dict:  # fmt: skip
    """The whole soak against a started :class:`~h2o_kv.vllm.serve.ServerProcess`; returns the result fields."""
    base, model = server.url, server.model
    prompts = soak_prompts(256, cfg.seed)
    before = server_counts(base)
    progress(f"soak: {cfg.clients} clients for {cfg.duration_s:.0f} s, {cfg.disconnect_fraction:.0%} disconnecting")
    processes_before = rss_by_process(server.pid)
    with ProcessMonitor(base, server.pid, interval=1.0) as monitor:
        started = time.monotonic()
        outcomes = asyncio.run(_load(base, model, api_key, cfg, prompts))
        load_s = time.monotonic() - started
        drained = drain(base)
    after_run = server_counts(base)
    accounting = check_outcomes(outcomes, {key: after_run[key] - before[key] for key in before})
    warm = cfg.warmup_fraction * load_s
    after = [row["rss"] for row in monitor.samples if warm <= row["t"] <= load_s and row["rss"]]
    level = after[0] if after else None
    rss = {
        "warmup_s": round(warm, 1),
        "at_warmup_end": level,
        "max_after_warmup": max(after) if after else None,
        "min_after_warmup": min(after) if after else None,
        "final": tree_rss(server.pid),
        "by_process_before": processes_before,
        "by_process_after": rss_by_process(server.pid),
        "by_process": rss_flatness(monitor.samples, warm, load_s),
    }
    rss["max_deviation"] = max(abs(v - level) for v in after) / level if after else None  # of the tree's sum
    rss["flat"] = bool(rss["by_process"]) and all(row["flat"] for row in rss["by_process"].values())
    done = {key: accounting[key] for key in ("requests", "completed", "disconnected", "error")}
    progress(f"soak: {done}; checking bad requests")
    bad = bad_requests(base, model, api_key, context, h2o_active)
    auth = auth_checks(base, model, api_key)
    addresses = listen_addresses(server.pid, server.options.port)
    checks = {
        "server_kept_serving": server.alive() and healthy(base, model, api_key),
        "every_request_accounted": accounting["unique_keys"] and accounting["errors_have_message"],
        "none_lost_or_duplicated": accounting["none_lost_or_duplicated"] and accounting["unique_response_ids"],
        "rss_flat_within_5pct": rss["flat"],  # every process
        "kv_usage_back_to_zero": drained.get("kv_usage") == 0 and drained.get("running") == 0,
        "bad_requests_4xx": all(row["ok"] is not False for row in bad),
        "api_key_enforced": auth["ok"],
        "binds_loopback_only": addresses == ["127.0.0.1"],
    }
    return {
        "soak": asdict(cfg),
        "load_seconds": round(load_s, 1),
        "checks": checks,
        "passed": all(value is not False for value in checks.values()),
        "accounting": accounting,
        "rss": rss,
        "drain": drained,
        "bad_requests": bad,
        "auth": auth,
        "listen_addresses": addresses,
        "peak_running": monitor.peak("running"),
        "peak_kv_usage": monitor.peak("kv_usage"),
        "timeline": monitor.timeline(),
        "rss_timeline": {
            "t": [row["t"] for row in monitor.samples],
            "by_process": [row["by_process"] for row in monitor.samples],
        },
        "outcomes": outcomes,
    }
