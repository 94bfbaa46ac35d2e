"""Shared helpers of tests/serving (the vLLM backend, in its own virtual environment: vLLM pins its own torch and
transformers): build a vLLM engine on a tiny model with or without the plugin, and watch its scheduler.

Every test module there skips itself, with the reason, where vLLM is not installed. Engines are shared per module (an
engine starts in ~20 s) and run with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so tests
read the scheduler's KV manager directly; the model worker is still its own process (vLLM's CPU executor).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections import defaultdict

import torch

from h2o_kv.vllm.config import ENV

BLOCK = 32  # small blocks, so a bounded request's block count visibly stops growing


@contextlib.contextmanager
def engine(model_dir, setting: dict | None, **options):
    """A ``vllm.LLM`` on ``model_dir`` with the plugin set to ``setting`` (None: vLLM without the plugin)."""
    from vllm import LLM

    previous = os.environ.get(ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if setting is None:
        os.environ.pop(ENV, None)
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.selector import _cached_get_attn_backend

        AttentionBackendEnum.CPU_ATTN.clear_override()  # a worker forked from here must not inherit the plugin's
        _cached_get_attn_backend.cache_clear()
    else:
        os.environ[ENV] = json.dumps(setting)
        from h2o_kv.vllm import plugin

        plugin.register()  # vLLM loads plugins once per process: an earlier engine may have run without a setting
    args = dict(dtype="float32", enforce_eager=True, max_model_len=512, block_size=BLOCK, skip_tokenizer_init=True)
    if setting is not None:
        args["enable_prefix_caching"] = False
    llm = LLM(str(model_dir), **(args | options))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


class Watch:
    """Records, after every scheduling step, the KV blocks each running request holds (read from the KV manager),
    how many requests run at once, and every preemption."""

    def __init__(self, llm):
        self.sched = scheduler(llm)
        self.manager = self.sched.kv_cache_manager.coordinator.single_type_managers[0]
        self.blocks: dict[str, list[int]] = defaultdict(list)  # request id -> blocks held, step by step
        self.computed: dict[str, list[int]] = defaultdict(list)
        self.prompt: dict[str, int] = {}
        self.running: list[int] = []
        self.preempted: list[str] = []
        self._schedule, self._preempt = self.sched.schedule, self.sched._preempt_request

    def __enter__(self):
        def schedule(*args, **kwargs):
            output = self._schedule(*args, **kwargs)
            self.running.append(len(self.sched.running))
            for request in self.sched.running:
                self.blocks[request.request_id].append(len(self.manager.req_to_blocks.get(request.request_id, ())))
                self.computed[request.request_id].append(request.num_computed_tokens)
                self.prompt[request.request_id] = request.num_prompt_tokens
            return output

        def preempt(request, *args, **kwargs):
            self.preempted.append(request.request_id)
            return self._preempt(request, *args, **kwargs)

        self.sched.schedule, self.sched._preempt_request = schedule, preempt
        return self

    def __exit__(self, *exc):
        self.sched.schedule, self.sched._preempt_request = self._schedule, self._preempt

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()


def random_prompts(lengths, seed: int = 1, vocab: int = 512) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def generate(llm, prompts, max_tokens: int, extra_args: list[dict | None] | dict | None = None) -> list[list[int]]:
    """Greedy token ids (``ignore_eos``), one list per prompt; ``extra_args``: the requests' ``vllm_xargs``."""
    from vllm import SamplingParams

    if not isinstance(extra_args, list):
        extra_args = [extra_args] * len(prompts)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False, extra_args=args)
        for args in extra_args
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def reference(model, prompt, max_tokens: int, **cache_options) -> list[int]:
    """h2o-kv's transformers backend (``H2OCache``), greedy, never stopping at EOS (as ``ignore_eos``)."""
    from h2o_kv import H2OCache, enable_h2o

    enable_h2o(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    cache = H2OCache(**cache_options)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()
