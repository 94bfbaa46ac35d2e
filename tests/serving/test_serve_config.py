"""The serving backend's settings and refusals without a server: the ratio's ``min_entries`` floor, per-request keys
(an unknown ``h2o_*`` key is refused), policies the backend does not run (``ada_*``, ``global_*``), and models or
engine options it does not implement (sliding windows, soft-capping, ALiBi, sinks, KV-cache groups, KV connectors),
refused in one line before serving."""

from __future__ import annotations

import importlib.util
import json
import os
import types

import pytest

from h2o_kv.vllm.config import (
    ENV,
    MIN_ENTRIES,
    REQUEST_KEYS,
    SERVER_POLICIES,
    ServeConfig,
    model_refusal,
    request_config,
)

HAS_VLLM = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None  # not tests/serving as a namespace
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'h2o-kv[vllm]')")


def test_a_server_ratio_has_the_floor_and_counts_do_not():
    assert MIN_ENTRIES == 256
    assert ServeConfig("h2o", budget=0.2).split(38) == (128, 128)  # a short chat: nothing evicted
    assert ServeConfig("h2o", budget=0.2).split(2000) == (200, 200)  # a long prompt: the ratio
    assert ServeConfig("h2o", budget=0.2, min_entries=0).split(38) == (3, 3)  # the paper's rule
    assert ServeConfig("h2o", budget=0.2, min_entries=64).split(38) == (32, 32)
    assert ServeConfig("h2o", heavy=8, recent=8).split(38) == (8, 8)
    assert ServeConfig("h2o", budget=0.2).describe() == "policy h2o, budget=0.2, min_entries=256"
    with pytest.raises(ValueError, match="min_entries is a floor under a ratio budget"):
        ServeConfig("h2o", heavy=8, recent=8, min_entries=64)
    with pytest.raises(ValueError, match="min_entries must be an integer >= 0"):
        ServeConfig("h2o", budget=0.2, min_entries=-3)


def test_the_floor_travels_in_the_environment():
    config = ServeConfig("h2o", budget=0.2, min_entries=64)
    assert ServeConfig.from_env({ENV: config.to_env()}) == config
    with pytest.raises(ValueError, match="min_entries"):
        ServeConfig.from_env({ENV: json.dumps({"policy": "h2o", "budgets": 0.2})})


def test_per_request_floor_and_counts():
    server = ServeConfig("h2o", budget=0.2)
    assert server.override({"h2o_min_entries": 0}).split(38) == (3, 3)
    assert server.override({"h2o_heavy": 4, "h2o_recent": 4}).split(38) == (4, 4)  # counts drop the ratio's floor
    assert ServeConfig("h2o", heavy=8, recent=8).override({"h2o_budget": 0.5}).split(38) == (128, 128)
    with pytest.raises(ValueError, match=r"invalid vllm_xargs \(h2o_min_entries\).*min_entries is a floor"):
        ServeConfig("h2o", heavy=8, recent=8).override({"h2o_min_entries": 16})


def test_an_unknown_h2o_key_names_the_key_and_the_valid_ones():
    with pytest.raises(ValueError) as caught:
        ServeConfig("h2o", budget=0.2).override({"h2o_hevy": 8})
    message = str(caught.value)
    assert "h2o_hevy" in message and all(key in message for key in REQUEST_KEYS) and "\n" not in message
    assert ServeConfig("h2o", budget=0.2).override({"other_plugin": 1}) == ServeConfig("h2o", budget=0.2)


def test_a_request_runs_the_server_setting_with_its_xargs_and_evicts_only_on_an_evicting_server(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert request_config({"h2o_heavy": 4, "h2o_recent": 4}) is None  # no plugin setting: vLLM's own
    monkeypatch.setenv(ENV, ServeConfig("h2o", budget=0.2).to_env())
    assert request_config(None) == ServeConfig("h2o", budget=0.2)
    assert request_config({"h2o_heavy": 4, "h2o_recent": 4}) == ServeConfig("h2o", heavy=4, recent=4)
    monkeypatch.setenv(ENV, ServeConfig("full").to_env())
    assert request_config({"h2o_policy": "full"}) == ServeConfig("full")
    with pytest.raises(ValueError, match="runs policy 'full' .* cannot ask for policy 'h2o'"):
        request_config({"h2o_policy": "h2o", "h2o_heavy": 4, "h2o_recent": 4})


@pytest.mark.parametrize("policy, phrase", [("ada_h2o", "own budget"), ("ada_snapkv", "own budget"),
                                            ("global_h2o", "across all layers")])  # fmt: skip
def test_policies_the_backend_does_not_run_are_refused(policy, phrase):
    assert policy not in SERVER_POLICIES
    with pytest.raises(ValueError, match=phrase):
        ServeConfig(policy, budget=0.2)
    with pytest.raises(ValueError, match=rf"invalid vllm_xargs \(h2o_policy\).*{phrase}"):
        ServeConfig("h2o", budget=0.2).override({"h2o_policy": policy})


def test_policy_options_are_read_by_the_registry():
    assert ServeConfig("a2sf:decay=0.95", budget=0.2).make_policy(100).decay == 0.95
    assert ServeConfig("h2o", budget=0.2).override({"h2o_policy": "snapkv:window=8"}).make_policy(100).window == 8
    with pytest.raises(ValueError, match=r"invalid vllm_xargs \(h2o_policy\).*decay must be a number in \(0, 1\]"):
        ServeConfig("h2o", budget=0.2).override({"h2o_policy": "a2sf:decay=2"})
    with pytest.raises(ValueError, match="policy h2o takes no options"):
        ServeConfig("h2o:decay=0.5", budget=0.2)
    assert not ServeConfig("full").evicts and ServeConfig("a2sf:decay=0.9", heavy=4, recent=4).evicts


def _text_config(family: str, **fields):
    import transformers

    return getattr(transformers, f"{family}Config")(**fields)


@pytest.mark.parametrize(
    "family, fields, phrase",
    [
        ("Llama", {}, None),
        ("Qwen2", {}, None),  # sliding_window given but use_sliding_window off (the default)
        ("Mistral", {"sliding_window": 4096}, "sliding-window attention"),
        ("Gemma2", {}, "layer types sliding_attention"),
        ("Gemma2", {"layer_types": ["full_attention"] * 26}, "logit soft-capping"),
        ("Falcon", {"alibi": True}, "ALiBi"),
        ("Bloom", {}, "ALiBi"),
    ],
)
def test_model_features_the_backend_does_not_implement(family, fields, phrase):
    config = _text_config(family, **fields)
    reason = model_refusal(config, tuple(getattr(config, "architectures", None) or (f"{family}ForCausalLM",)))
    assert reason is None if phrase is None else phrase in reason


@needs_vllm
def test_each_layer_is_checked_as_vllm_builds_it(monkeypatch):
    from h2o_kv.vllm.attention import check_layer

    monkeypatch.setenv(ENV, ServeConfig("h2o", budget=0.2).to_env())
    plain = dict(alibi_slopes=None, sliding_window=-1, logits_soft_cap=0, sinks=None, attn_type="decoder",
                 kv_sharing_target_layer_name=None)  # fmt: skip
    check_layer(types.SimpleNamespace(**plain))
    for field, value, phrase in [("sinks", object(), "attention sinks"), ("sliding_window", 512, "sliding-window"),
                                 ("logits_soft_cap", 30.0, "soft-capping"), ("alibi_slopes", [0.5], "ALiBi"),
                                 ("attn_type", "encoder_only", "decoder self-attention only")]:  # fmt: skip
        with pytest.raises(ValueError, match=phrase):
            check_layer(types.SimpleNamespace(**(plain | {field: value})))
    monkeypatch.setenv(ENV, ServeConfig("full").to_env())
    check_layer(types.SimpleNamespace(**(plain | {"sinks": object()})))  # the full cache is vLLM's own


@needs_vllm
def test_kv_cache_groups_other_than_one_full_attention_group_are_refused(monkeypatch):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from h2o_kv.vllm import plugin

    monkeypatch.setenv(ENV, ServeConfig("h2o", budget=0.2).to_env())
    plugin.register()
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    for groups, names in [([full, full], "FullAttentionSpec, FullAttentionSpec"), ([window], "SlidingWindowSpec")]:
        specs = [KVCacheGroupSpec([f"layer.{i}"], group) for i, group in enumerate(groups)]
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=specs)
        with pytest.raises(ValueError, match=f"one full-attention KV-cache group; this model has {names}"):
            KVCacheManager(config, max_model_len=64, scheduler_block_size=16, hash_block_size=16,
                           enable_caching=False)  # fmt: skip


@needs_vllm
def test_bounded_blocks_come_from_vllms_kv_cache_spec_registry(monkeypatch):
    """The H2O backend turns a full-attention spec into H2OAttentionSpec (same layout); vLLM's registry gives it the
    reservation-aware manager, so the engine's KV manager is H2O's without a patch of FullAttentionManager."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from h2o_kv.vllm import plugin
    from h2o_kv.vllm.attention import H2OAttentionBackend
    from h2o_kv.vllm.blocks import H2OAttentionManager, H2OAttentionSpec

    monkeypatch.setenv(ENV, ServeConfig("h2o", budget=0.2).to_env())
    plugin.register()
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    spec = H2OAttentionBackend.customize_spec(full)
    assert type(spec) is H2OAttentionSpec and spec.page_size_bytes == full.page_size_bytes
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    assert H2OAttentionBackend.customize_spec(window) == window  # left to vLLM, then refused (test above)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=16, hash_block_size=16,
                             enable_caching=False)  # fmt: skip
    assert [type(m) for m in manager.coordinator.single_type_managers] == [H2OAttentionManager]
    assert not hasattr(FullAttentionManager.allocate_new_blocks, "__wrapped__")  # vLLM's own, unpatched


@needs_vllm
def test_engine_config_refuses_a_sliding_window_model_and_kv_connectors(tmp_path, monkeypatch):
    """What ``vllm.LLM`` or ``vllm serve`` with the plugin refuses before its engine starts (the API process)."""
    from tiny import make_tiny_llama
    from transformers import MistralConfig
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from h2o_kv.vllm import plugin

    monkeypatch.setenv(ENV, ServeConfig("h2o", budget=0.2).to_env())
    plugin.register()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the runner the patches patch
    mistral = tmp_path / "mistral"
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512)  # fmt: skip
    MistralConfig(**shape, sliding_window=64).save_pretrained(mistral)
    args = dict(dtype="float32", enforce_eager=True, enable_prefix_caching=False, skip_tokenizer_init=True,
                max_model_len=256)  # fmt: skip
    with pytest.raises(ValueError, match="does not support sliding-window attention"):
        EngineArgs(str(mistral), **args).create_engine_config()
    llama = tmp_path / "llama"
    make_tiny_llama(llama)
    EngineArgs(str(llama), **args).create_engine_config()  # the plugin's own model runs
    connector = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match="KV connectors"):
        EngineArgs(str(llama), kv_transfer_config=connector, **args).create_engine_config()


def test_the_worker_returns_its_freed_heap_every_few_seconds(monkeypatch):
    """:func:`h2o_kv.vllm.heap.after_step` (called after each worker step) trims once per interval, not per step."""
    from h2o_kv.bench import memory
    from h2o_kv.vllm import heap

    clock, trims = [1000.0], []
    monkeypatch.setattr(heap.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(memory, "trim_heap", lambda: trims.append(clock[0]))
    monkeypatch.setattr(heap, "_last_trim", clock[0])
    for _ in range(40):  # 40 steps of 0.5 s
        clock[0] += 0.5
        heap.after_step()
    assert trims == [1000.0 + 5.0 * k for k in (1, 2, 3, 4)]
