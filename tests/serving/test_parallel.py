"""H2O inside vLLM with tensor parallelism on the CPU (2 ranks, vLLM's ``mp`` executor): each rank holds half of
the tiny model's KV heads and evicts them itself; the greedy tokens equal one rank's and the transformers
backend's, a per-request setting reaches both ranks, and the blocks are bounded in the scheduler (one block table
for all ranks) and on every rank (the slots each worker uses, read in the worker).

Data parallel: ``h2o-kv serve -- --data-parallel-size 2`` (one API server, vLLM's internal load balancer, two
independent engine cores, each with its own worker, block pool and H2O reservations) gives one engine's greedy tokens
over HTTP, and each engine core's KV blocks (vLLM's per-engine ``/metrics``) stay bounded while all requests decode."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'h2o-kv[vllm]', see docs/vllm.md)", allow_module_level=True)

from engines import BLOCK, Watch, engine, generate, random_prompts, reference
from tiny import make_tiny_llama

RANKS = 2
KV_HEADS = 2  # the tiny model's (tests/serving/tiny.py)
LENGTHS = (40, 64, 90, 150)  # 150 is prefilled in chunks
NEW = 32
SETTING = {"policy": "h2o", "heavy": 12, "recent": 12}  # 24 entries: well below every sequence
XARGS = {"h2o_heavy": 8, "h2o_recent": 4}
OPTIONS = dict(max_num_batched_tokens=128, kv_cache_memory_bytes=24 * 32 * 2**10, num_gpu_blocks_override=24)
PARALLEL = dict(tensor_parallel_size=RANKS, distributed_executor_backend="mp")
PROMPTS = random_prompts(LENGTHS, seed=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_tp")
    model = make_tiny_llama(path)
    assert model.config.num_key_value_heads == KV_HEADS and KV_HEADS % RANKS == 0  # each rank: whole KV heads
    return path, model


@pytest.fixture(scope="module")
def one_rank(tiny):
    """One rank's greedy tokens (the default setting, then the per-request one)."""
    with engine(tiny[0], SETTING, **OPTIONS) as llm:
        return generate(llm, PROMPTS, NEW), generate(llm, PROMPTS, NEW, XARGS)


@pytest.fixture(scope="module")
def two_ranks(tiny, one_rank):
    # one core per rank (vLLM binds each rank's OpenMP threads); the KV space per rank is kv_cache_memory_bytes
    bind = "|".join(map(str, range(RANKS))) if (os.cpu_count() or 1) >= RANKS else "nobind"
    saved = {key: os.environ.get(key) for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the legacy variable would override kv_cache_memory_bytes
    try:
        with engine(tiny[0], SETTING, **OPTIONS, **PARALLEL) as llm:
            yield llm
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def watch_slots(worker) -> None:
    """In a worker: record, for every bounded row the attention backend plans, the slots it attends, the blocks of
    the block table it uses and the KV heads its per-layer state holds."""
    from h2o_kv.vllm import attention

    builder = attention.H2OAttentionMetadataBuilder
    if hasattr(builder, "_original_plan"):
        return
    builder._original_plan, builder.watched = builder._plan, []

    def _plan(self, runner, common):
        rows = builder._original_plan(self, runner, common)
        for index, row in rows:
            heads = {layer.pos.shape[0] for layer in row.entries.layers.values() if layer.pos is not None}
            builder.watched.append((runner.input_batch.req_ids[index], row.column, row.slots, len(row.blocks), heads))
        return rows

    builder._plan = _plan


def watched_slots(worker) -> tuple[int, list]:
    from h2o_kv.vllm import attention

    builder = attention.H2OAttentionMetadataBuilder
    rows, builder.watched = builder.watched, []
    return worker.rank, rows


def test_two_ranks_evict_like_one_rank_and_the_transformers_backend(two_ranks, one_rank, tiny):
    got = generate(two_ranks, PROMPTS, NEW)
    assert got == one_rank[0]
    assert got == [reference(tiny[1], prompt, NEW, heavy=12, recent=12) for prompt in PROMPTS]
    unbounded = generate(two_ranks, PROMPTS, NEW, {"h2o_heavy": 512, "h2o_recent": 512})
    assert sum(g != u for g, u in zip(got, unbounded, strict=True)) >= len(PROMPTS) // 2  # eviction changed them


def test_a_per_request_setting_reaches_every_rank(two_ranks, one_rank, tiny):
    got = generate(two_ranks, PROMPTS, NEW, XARGS)
    assert got == one_rank[1]
    assert got == [reference(tiny[1], prompt, NEW, heavy=8, recent=4) for prompt in PROMPTS]


def test_blocks_are_bounded_in_the_scheduler_and_on_every_rank(two_ranks):
    capacity = SETTING["heavy"] + SETTING["recent"]
    free = Watch(two_ranks).free_blocks()
    two_ranks.collective_rpc(watch_slots)
    with Watch(two_ranks) as watch:
        generate(two_ranks, PROMPTS, NEW)
    ranks = dict(two_ranks.collective_rpc(watched_slots))
    ranks_heads = KV_HEADS // RANKS
    assert sorted(ranks) == list(range(RANKS))
    for request_id, held in watch.blocks.items():  # the scheduler: one block table for all ranks
        prompt, computed = watch.prompt[request_id], watch.computed[request_id]
        steady = math.ceil(min(prompt + NEW, capacity + 1) / BLOCK)
        assert all(h == steady for h, c in zip(held, computed, strict=True) if c > prompt)
    assert watch.preempted == [] and watch.free_blocks() == free
    for rank, rows in ranks.items():  # each worker: its own heads, slots within the blocks the scheduler left
        assert {request for request, *_ in rows} == set(watch.prompt), rank
        decode = [row for row in rows if row[1] >= watch.prompt[row[0]]]
        assert decode and all(
            slots <= capacity + 1 and blocks == math.ceil(slots / BLOCK) for _, _, slots, blocks, _ in decode
        )
        assert all(heads == {ranks_heads} for *_, heads in decode), rank
    assert ranks[0] == ranks[1]  # the same rows, slot counts and blocks on both ranks


def worker_requests(worker) -> list[str]:
    from h2o_kv.vllm import attention

    return sorted(attention._REQUESTS)


def test_every_rank_drops_finished_and_aborted_requests(two_ranks):
    """The per-request state each worker keeps (``attention._REQUESTS``) is dropped on every rank when the scheduler
    reports the request finished, aborts included (a finished request is reported with the next step)."""
    from vllm import SamplingParams

    engine_ = two_ranks.llm_engine
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(PROMPTS):
        engine_.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(6):
        engine_.step()
    assert all(held for held in two_ranks.collective_rpc(worker_requests))  # the workers hold their state
    engine_.abort_request([f"abort-{i}" for i in range(len(PROMPTS))])
    while engine_.has_unfinished_requests():
        engine_.step()
    generate(two_ranks, PROMPTS[:1], 2)  # one more request: its steps carry the aborted ids to the workers
    held = two_ranks.collective_rpc(worker_requests)
    assert len(held) == RANKS and all(len(ids) <= 1 and not any(i.startswith("abort-") for i in ids) for ids in held)


# -- data parallel: two engine cores behind one API server ----------------------------------------------------------

REPLICAS = 2
BLOCKS = 24  # per engine core (OPTIONS' pool): vLLM keeps one as its null block
DP_PORT = int(os.environ.get("H2O_KV_TEST_SERVE_PORT", "8201")) + 3
DP_CONTEXT = (BLOCKS - 1) * BLOCK  # 736: vLLM wants one full-length request to fit in an engine core's pool
DP_NEW = 580  # long decodes (150 + 580 <= 736): a window in which every request on both engine cores decodes
METRICS = {"vllm:num_requests_running": "running", "vllm:kv_cache_usage_perc": "usage",
           "vllm:num_preemptions_total": "preempted", "vllm:request_success_total": "finished",
           "vllm:time_to_first_token_seconds_count": "first", "vllm:generation_tokens_total": "generated"}  # fmt: skip


@pytest.fixture(scope="module")
def data_parallel(tiny, tmp_path_factory):
    """``h2o-kv serve --policy h2o --heavy 12 --recent 12 -- --data-parallel-size 2`` on the tiny model (no tokenizer:
    token ids in and out), each engine core with OPTIONS' KV pool and one core of its own."""
    from h2o_kv.vllm.config import ServeConfig
    from h2o_kv.vllm.serve import ServeOptions, ServerProcess

    extra = ("--data-parallel-size", str(REPLICAS), "--skip-tokenizer-init", "--block-size", str(BLOCK),
             "--max-num-batched-tokens", str(OPTIONS["max_num_batched_tokens"]),
             "--num-gpu-blocks-override", str(BLOCKS))  # fmt: skip
    options = ServeOptions(ServeConfig(**SETTING), model=str(tiny[0]), port=DP_PORT, max_model_len=DP_CONTEXT,
                           kv_cache_gb=OPTIONS["kv_cache_memory_bytes"] / 2**30, extra=extra)  # fmt: skip
    server = ServerProcess(options, log=tmp_path_factory.mktemp("serve-dp") / "server.log", startup_timeout=900)
    bind = "|".join(map(str, range(REPLICAS))) if (os.cpu_count() or 1) >= REPLICAS else "nobind"
    server.env["VLLM_CPU_OMP_THREADS_BIND"] = bind  # one core per engine core's worker (one list per DP rank)
    server.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by engines.engine for the in-process engines
    with server:
        yield server


def engine_metrics(server) -> dict[str, dict[str, float]]:
    """Per engine core (the ``engine`` label of vLLM's metrics, all updated together once per step): running
    requests, KV blocks in use, preemptions, finished requests, requests past their first token, generated tokens
    (read from the text format directly: fast enough to sample every 50 ms)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(METRICS.values(), 0.0))
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        engine = re.search(r'engine="(\d+)"', rest) if name in METRICS else None
        if engine:
            out[engine[1]][METRICS[name]] += float(rest.rsplit(" ", 1)[1])
    for values in out.values():
        values["blocks"] = round(values.pop("usage") * (BLOCKS - 1))  # vLLM's usage leaves the null block out
    return dict(out)


def complete(server, prompts, max_tokens: int, extra_args: list | None = None) -> list[list[int]]:
    """Greedy completions (``ignore_eos``), all sent at once over HTTP; their token ids, in order."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)  # thread-safe: shared

    def one(job):
        prompt, xargs = job
        extra = {"ignore_eos": True, "return_token_ids": True} | ({"vllm_xargs": xargs} if xargs else {})
        reply = client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra)  # fmt: skip
        return list(reply.choices[0].token_ids)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, zip(prompts, extra_args or [None] * len(prompts), strict=True)))


def test_data_parallel_replicas_evict_like_one_engine(data_parallel, one_rank):
    """All requests at once, the server-wide and a per-request setting mixed: both engine cores serve some, and every
    request's greedy tokens equal one engine's (DP=1, the ``vllm.LLM`` above)."""
    before = engine_metrics(data_parallel)
    assert sorted(before) == [str(i) for i in range(REPLICAS)]
    got = complete(data_parallel, PROMPTS * 2, NEW, [None] * len(PROMPTS) + [XARGS] * len(PROMPTS))
    assert got == one_rank[0] + one_rank[1]
    after = engine_metrics(data_parallel)
    served = {core: after[core]["finished"] - before[core]["finished"] for core in after}
    assert sum(served.values()) == 2 * len(PROMPTS) and all(served.values()), served  # vLLM's balancer used both


def decoding(samples) -> dict[str, list[dict]]:
    """Per engine core, the samples in which every request it runs is past its first token, no request got its
    first token since the engine core's previous such sample, and it has stepped since (its generated-token count
    grew): so every running prompt was compressed in an earlier step, and the scheduler has freed its tail blocks
    since (``remove_skipped_blocks``, at the next step's allocation)."""
    window, previous = defaultdict(list), {}
    for engines in samples:
        for core, e in engines.items():
            if not (e["running"] >= 1 and e["first"] - e["finished"] == e["running"]):
                previous.pop(core, None)
                continue
            last = previous.get(core)
            if last is not None and e["first"] == last["first"] and e["generated"] > last["generated"]:
                window[core].append(e)
            previous[core] = e
    return window


def test_every_engine_core_holds_bounded_blocks(data_parallel):
    """8 requests at once of up to 150 + 580 tokens (23 blocks each at full length, an engine core's whole pool):
    while they decode, each engine core holds at most one block per running request (``heavy + recent + 1``
    slots), where a full cache would already hold at least two; nothing is preempted and every block comes back.
    Sampled every 50 ms; on 2 busy cores a batch may leave few samples, so up to 4 batches run, until each engine
    core has 3."""
    capacity = SETTING["heavy"] + SETTING["recent"]
    steady = math.ceil(min(min(LENGTHS) + DP_NEW, capacity + 1) / BLOCK)
    assert steady < min(math.ceil((n + 1) / BLOCK) for n in LENGTHS)  # below every full request's blocks
    before = engine_metrics(data_parallel)
    assert all(e["first"] == e["finished"] and not e["running"] for e in before.values()), before  # none in flight
    samples, stop, batches = [], threading.Event(), 0

    def poll():
        while not stop.is_set():
            samples.append(engine_metrics(data_parallel))
            stop.wait(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        while batches < 4 and (batches == 0 or min(len(decoding(samples).get(e, ())) for e in before) < 3):
            done = complete(data_parallel, PROMPTS * 2, DP_NEW)
            assert all(len(tokens) == DP_NEW for tokens in done)
            batches += 1
    finally:
        stop.set()
        poller.join(timeout=30)
    window = decoding(samples)
    assert sorted(window) == sorted(before) and all(len(rows) >= 3 for rows in window.values()), (batches, samples)
    for core, rows in window.items():
        assert all(e["blocks"] <= e["running"] * steady for e in rows), (core, rows)
    after, deadline = engine_metrics(data_parallel), time.monotonic() + 30
    while any(e["blocks"] for e in after.values()) and time.monotonic() < deadline:  # the last step's stats
        time.sleep(0.5)
        after = engine_metrics(data_parallel)
    assert all(after[e]["blocks"] == 0 and after[e]["preempted"] == before[e]["preempted"] for e in after), after
    assert sum(after[e]["finished"] - before[e]["finished"] for e in after) == batches * 2 * len(PROMPTS)
