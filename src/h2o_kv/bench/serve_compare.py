"""Measure H2O inside vLLM on the default model: agreement with the transformers backend, and full vs H2O.

``python -m h2o_kv.bench.serve_compare [--prompts 10] [--length 1024] [--new 64] [--budget 0.2] [--batch 4]
[--out results/vllm/compare.json]`` (needs vLLM and ``H2O_KV_DATA``: the prompts are PG-19 windows).

1. Agreement: each prompt through vLLM with the plugin (greedy, ``ignore_eos``) and through h2o-kv's transformers
   backend (``H2OCache``, same budget): the fraction of generated positions with the same token, the first
   divergence per prompt and, there, the reference's margin between its token and vLLM's (a near-tie explains a
   divergence: vLLM's fused linear/norm/RoPE kernels round differently from transformers', and greedy decoding
   follows the first flip).
2. Full vs H2O in one engine (same prompts, same KV space; the setting is per request through ``vllm_xargs``),
   batches alternating: the KV blocks each request holds while decoding (read from the scheduler's KV manager)
   and decode ms per step, timed on pure decode steps only (no prefill token in the step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _engine(model_dir: str, setting: dict, kv_gb: float):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: read its KV manager
    from ..vllm.config import ENV

    os.environ[ENV] = json.dumps(setting)
    from vllm import LLM

    return LLM(
        model_dir, dtype="float32", enforce_eager=True, max_model_len=4096, enable_prefix_caching=False,
        kv_cache_memory_bytes=int(kv_gb * 2**30), max_num_batched_tokens=4096,
    )  # fmt: skip


def _params(new: int, xargs=None, logprobs=None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, extra_args=xargs, logprobs=logprobs)


def agreement(llm, model, prompts, new: int, budget: float) -> dict:
    import torch

    from .. import H2OCache

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(new, logprobs=2), use_tqdm=False)
    model.generation_config.eos_token_id = None
    rows = []
    for prompt, output in zip(prompts, outputs, strict=True):
        got = list(output.outputs[0].token_ids)
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]), past_key_values=H2OCache(budget=budget), max_new_tokens=new, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        expected = ref.sequences[0, len(prompt) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b), None)
        row = {"same": sum(a == b for a, b in zip(expected, got, strict=True)), "first_divergence": first}
        if first is not None:
            logits = ref.scores[first][0]
            row["reference_margin"] = float(logits[expected[first]] - logits[got[first]])  # its token over vLLM's
            lp = output.outputs[0].logprobs[first]
            if expected[first] in lp:
                row["vllm_margin"] = float(lp[got[first]].logprob - lp[expected[first]].logprob)
        rows.append(row)
    same = sum(r["same"] for r in rows)
    return {"prompts": rows, "tokens": new * len(prompts), "same": same, "agreement": same / (new * len(prompts))}


def _decode_steps(llm, prompts, new: int, xargs) -> tuple[list[float], list[int]]:
    """Run one batch step by step: (ms of each pure decode step, blocks each request holds at the last step)."""
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    ids = [f"{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, _params(new, xargs))
    steps, blocks = [], []
    while engine.has_unfinished_requests():
        running = sched.running
        decoding = len(running) == len(prompts) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if decoding and not sched.waiting:
            steps.append(elapsed * 1000)
            blocks = [len(manager.req_to_blocks.get(r.request_id, ())) for r in sched.running] or blocks
    return steps, blocks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--out", default="results/vllm/compare.json")
    args = parser.parse_args(argv)

    from .. import load_model
    from ..harness import records
    from ..models import model_dir
    from .workload import make_prompts

    model, tokenizer = load_model()
    prompts = make_prompts(tokenizer, max(args.prompts, args.batch), args.length).tolist()
    setting = {"policy": "h2o", "budget": args.budget, "min_entries": 0}  # the paper's rule, as H2OCache(budget=...)
    llm = _engine(str(model_dir()), setting, args.kv_cache_gb)
    print(f"agreement: {args.prompts} prompts x {args.new} tokens ...", flush=True)
    agree = agreement(llm, model, prompts[: args.prompts], args.new, args.budget)
    print(f"  {agree['same']}/{agree['tokens']} = {agree['agreement']:.1%}", flush=True)
    timing = {"full": [], "h2o": []}
    held = {}
    batch = prompts[: args.batch]
    for round_ in range(args.rounds):
        for name, xargs in (("full", {"h2o_policy": "full"}), ("h2o", None)):  # alternating, same engine
            steps, blocks = _decode_steps(llm, batch, args.new, xargs)
            timing[name] += steps
            held[name] = blocks
            print(f"  round {round_}: {name} {statistics.median(steps):.1f} ms/step, blocks {blocks}", flush=True)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    fields = {
        "model": "SmolLM2-135M-Instruct",
        "setting": setting,
        "prompt_length": args.length,
        "new_tokens": args.new,
        "block_size": block_size,
        "kv_cache_gb": args.kv_cache_gb,
        "agreement": agree,
        "comparison": {
            name: {
                "batch": args.batch,
                "blocks_per_request": held[name],
                "decode_ms_per_step_median": statistics.median(timing[name]),
                "decode_ms_per_step_mean": statistics.fmean(timing[name]),
                "decode_steps_timed": len(timing[name]),
            }
            for name in timing
        },
        "note": "full and h2o alternate in one engine (per-request vllm_xargs), on a shared 2-core machine",
    }
    fields["comparison"]["decode_speedup_median"] = (
        fields["comparison"]["full"]["decode_ms_per_step_median"]
        / fields["comparison"]["h2o"]["decode_ms_per_step_median"]
    )
    records.write(args.out, "vllm-compare", fields, device="cpu", h2o_cache=True)
    print(json.dumps(fields["comparison"], indent=1))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
