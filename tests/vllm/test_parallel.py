"""H2O inside vLLM with tensor parallelism on the CPU (2 ranks, vLLM's ``mp`` executor): each rank holds half of
the tiny model's KV heads and evicts them itself; the greedy tokens equal one rank's and the transformers
backend's, a per-request setting reaches both ranks, and the blocks are bounded in the scheduler (one block table
for all ranks) and on every rank (the slots each worker uses, read in the worker)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

if getattr(importlib.util.find_spec("vllm"), "origin", None) is None:  # not installed, or only tests/vllm (namespace)
    pytest.skip("vLLM is not installed (pip install 'h2o-kv[vllm]', see docs/vllm.md)", allow_module_level=True)

from engines import BLOCK, Watch, engine, generate, random_prompts, reference
from tiny import make_tiny_llama

RANKS = 2
KV_HEADS = 2  # the tiny model's (tests/vllm/tiny.py)
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
