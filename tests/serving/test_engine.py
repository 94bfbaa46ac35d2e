"""H2O inside vLLM on a tiny random Llama: equality with vLLM and with h2o-kv's transformers backend, the block
bound read from the engine, overload, aborts, per-request settings and refusals."""

from __future__ import annotations

import importlib.util
import math

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'h2o-kv[vllm]', see docs/vllm.md)", allow_module_level=True)

from engines import BLOCK, Watch, engine, generate, random_prompts, reference
from tiny import make_tiny_llama

from h2o_kv.vllm import blocks, patches

LENGTHS = (33, 45, 64, 70, 90, 100, 150, 200)  # one batch of mixed lengths; 150 and 200 are prefilled in chunks
NEW = 40
SETTING = {"policy": "h2o", "heavy": 16, "recent": 16}
OPTIONS = dict(
    max_num_batched_tokens=128, kv_cache_memory_bytes=24 * 32 * 2**10, num_gpu_blocks_override=24
)  # a pool of 24 blocks (32 KiB each); prompts over 128 tokens are prefilled in chunks
PROMPTS = random_prompts(LENGTHS)
HUGE = {"h2o_heavy": 1024, "h2o_recent": 1024}  # a budget covering every sequence


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_tiny_llama(path)


@pytest.fixture(scope="module")
def plain(tiny):
    """Outputs of vLLM without the plugin (its own engine, closed before the plugin's starts)."""
    with engine(tiny[0], None, **OPTIONS) as llm:
        return generate(llm, PROMPTS, NEW)


@pytest.fixture(scope="module")
def llm(tiny, plain):
    with engine(tiny[0], SETTING, **OPTIONS) as llm:
        yield llm


def test_budget_covering_every_sequence_is_vllm_itself(llm, plain):
    assert generate(llm, PROMPTS, NEW, HUGE) == plain


def test_h2o_equals_the_transformers_backend(llm, tiny, plain):
    got = generate(llm, PROMPTS, NEW)
    expected = [reference(tiny[1], prompt, NEW, heavy=16, recent=16) for prompt in PROMPTS]
    assert got == expected
    assert sum(g != p for g, p in zip(got, plain, strict=True)) >= len(PROMPTS) // 2  # eviction changed most outputs


@pytest.mark.parametrize(
    "xargs, options",
    [
        ({"h2o_heavy": 8, "h2o_recent": 4}, dict(heavy=8, recent=4)),
        ({"h2o_budget": 0.3, "h2o_min_entries": 0}, dict(budget=0.3)),  # the paper's rule (the server floors a ratio)
        ({"h2o_budget": 0.3, "h2o_min_entries": 48}, dict(budget=0.3, min_entries=48)),  # 48 > 0.3 * 100: floored
        ({"h2o_policy": "local", "h2o_heavy": 0, "h2o_recent": 24}, dict(policy="local", heavy=0, recent=24)),
        ({"h2o_policy": "tova"}, dict(policy="tova", heavy=16, recent=16)),
        ({"h2o_policy": "a2sf:decay=0.9"}, dict(policy="a2sf", heavy=16, recent=16, decay=0.9)),  # a policy's option
        ({"h2o_policy": "keydiff"}, dict(policy="keydiff", heavy=16, recent=16)),  # ranks by keys (read in Python)
        # compresses the prompt, then grows; capacity 48 > its window of 32, so the window's scores choose 16 entries
        ({"h2o_policy": "snapkv", "h2o_heavy": 40, "h2o_recent": 8}, dict(policy="snapkv", heavy=40, recent=8)),
        # the question-aware H2O compressing the prompt once, then growing (kvpress' protocol)
        (
            {"h2o_policy": "window_h2o:decode=grow", "h2o_heavy": 16, "h2o_recent": 16},
            dict(policy="window_h2o", heavy=16, recent=16, decode="grow"),
        ),
    ],
    ids=["counts", "ratio", "floor", "local", "tova", "a2sf", "keydiff", "snapkv", "window_h2o_grow"],
)
def test_per_request_settings_equal_the_transformers_backend(llm, tiny, xargs, options):
    prompts = PROMPTS[2:6]
    assert generate(llm, prompts, NEW, xargs) == [reference(tiny[1], p, NEW, **options) for p in prompts]


@pytest.mark.parametrize("policy", ["snapkv", "window_h2o"])
def test_observation_window_spans_the_prompt_chunks(llm, tiny, policy):
    """The observation window is the prompt's last 32 queries however the prompt is chunked: prompts of 140 and 150
    tokens are prefilled as 128 + 12 and 128 + 22 (128 tokens per step), so most of the window lies in the first
    chunk; 200 (128 + 72) has it in the last. A capacity of 48 > 32 keeps entries by the window's scores."""
    xargs = {"h2o_policy": policy, "h2o_heavy": 24, "h2o_recent": 24}
    prompts = random_prompts((140, 150, 200), seed=3)
    got = [generate(llm, [prompt], NEW, xargs)[0] for prompt in prompts]  # one at a time: the chunks above
    assert got == [reference(tiny[1], prompt, NEW, policy=policy, heavy=24, recent=24) for prompt in prompts]


def test_mixed_batch_of_settings(llm, tiny, plain):
    """Bounded and full-cache requests in one batch: each gets its own setting."""
    xargs = [None, {"h2o_policy": "full"}, {"h2o_heavy": 8, "h2o_recent": 8}, HUGE]
    got = generate(llm, PROMPTS[4:8], NEW, xargs)
    assert got[0] == reference(tiny[1], PROMPTS[4], NEW, heavy=16, recent=16)
    assert got[1] == plain[5] and got[3] == plain[7]
    assert got[2] == reference(tiny[1], PROMPTS[6], NEW, heavy=8, recent=8)


def test_blocks_never_exceed_the_bound(llm):
    """Read from the scheduler's KV manager at every step: a bounded request holds its prompt's blocks until the
    prompt is computed, then cdiv(heavy + recent + 1, block) blocks; all blocks return to the pool."""
    sched_free = Watch(llm).free_blocks()
    with Watch(llm) as watch:
        generate(llm, PROMPTS, NEW)
    capacity = SETTING["heavy"] + SETTING["recent"]
    assert sorted(watch.prompt.values()) == sorted(LENGTHS)
    for request_id, held in watch.blocks.items():
        prompt, computed = watch.prompt[request_id], watch.computed[request_id]
        steady = math.ceil(min(prompt + NEW, capacity + 1) / BLOCK)
        assert max(held) == math.ceil(max(prompt, steady * BLOCK) / BLOCK)  # the whole prompt while prefilling
        assert all(
            h == steady for h, c in zip(held, computed, strict=True) if c > prompt
        )  # the bound once it is computed
    assert watch.preempted == []
    assert watch.free_blocks() == sched_free  # everything returned


def test_overload_admits_by_the_bounded_size_and_never_preempts(llm, tiny):
    """12 requests whose full caches (5 blocks each) fit 4 at a time in the 24-block pool: bounded to one block each
    after their prompts, many more run at once, none is preempted and every output equals the reference."""
    prompts = random_prompts([100] * 12, seed=2)
    xargs = {"h2o_heavy": 15, "h2o_recent": 16}  # 31 entries + the step's one: exactly one block
    with Watch(llm) as watch:
        got = generate(llm, prompts, NEW, xargs)
    assert watch.preempted == []
    full_at_once = 24 // math.ceil((100 + NEW) / BLOCK)
    assert max(watch.running) > 2 * full_at_once
    assert all(held[-1] == 1 for held in watch.blocks.values())
    assert got == [reference(tiny[1], p, NEW, heavy=15, recent=16) for p in prompts]


def test_full_cache_requests_under_overload_are_not_preempted_either(llm, plain):
    with Watch(llm) as watch:
        got = generate(llm, PROMPTS, NEW, {"h2o_policy": "full"})
    assert got == plain
    assert watch.preempted == []


def test_abort_frees_everything(llm):
    from vllm import SamplingParams

    engine_ = llm.llm_engine
    free = Watch(llm).free_blocks()
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine_.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(8):
        engine_.step()
    assert Watch(llm).free_blocks() < free
    engine_.abort_request([f"abort-{i}" for i in range(4)])
    while engine_.has_unfinished_requests():
        engine_.step()
    engine_.step()
    assert Watch(llm).free_blocks() == free
    assert blocks.reservations() == {}


def test_invalid_request_setting_is_a_validation_error(llm):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"h2o_heavy.*heavy must be an integer >= 0"):
        generate(llm, PROMPTS[:1], 4, {"h2o_heavy": -1})
    with pytest.raises(VLLMValidationError, match="policy must be one of"):
        generate(llm, PROMPTS[:1], 4, {"h2o_policy": "nope"})
    assert len(generate(llm, PROMPTS[:1], 4)[0]) == 4  # the engine is unaffected


def test_prefix_caching_and_speculative_decoding_are_refused(tiny):
    with pytest.raises(ValueError, match="enable_prefix_caching must be off"):
        with engine(tiny[0], SETTING, enable_prefix_caching=True):
            pass
    with pytest.raises(ValueError, match="needs dtype float32 and kv_cache_dtype auto.*got dtype bfloat16"):
        with engine(tiny[0], SETTING, dtype="bfloat16"):
            pass
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        with engine(tiny[0], SETTING, speculative_config=spec):
            pass


def test_other_vllm_versions_are_refused(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match=r"tested with vLLM 0\.32\.0 only .* installed: vLLM 0\.99\.0"):
        patches.check_version()
