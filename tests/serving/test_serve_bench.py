"""``h2o-kv bench serve`` / ``bench soak`` logic that needs no server: the KV arithmetic, the settings, the decode
step from streamed token times, the request accounting, the tables."""

from __future__ import annotations

import json

import pytest

from h2o_kv.bench.serve import Setting, kv_space_bytes, model_kv_bytes_per_token, steady_step_ms
from h2o_kv.bench.serve_report import comparison_table
from h2o_kv.bench.soak import SoakConfig, check_outcomes

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576}  # fmt: skip


def test_kv_space_holds_exactly_four_decode_heavy_requests(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert model_kv_bytes_per_token(tmp_path) == 2 * 30 * 3 * 64 * 4 == 46_080
    space = kv_space_bytes(tmp_path, 1024 + 1024, fit=4)
    block = 128 * 46_080
    assert space == (4 * 16 + 1) * block == 383_385_600  # 16 blocks per request, plus vLLM's null block
    assert space / 2**30 == 0.3570556640625  # exact in binary: --kv-cache-gb round-trips to the same bytes
    assert kv_space_bytes(tmp_path, 1025 + 1024, fit=4) == (4 * 17 + 1) * block  # a partial block is a block


def test_settings_parse_with_their_labels():
    assert Setting.parse("full").config.evicts is False
    assert Setting.parse("h2o", 0.2).label == "h2o@0.2"
    setting = Setting.parse("h2o@256+128")
    assert (setting.config.heavy, setting.config.recent, setting.file_label) == (256, 128, "h2o_256_128")
    assert Setting.parse("h2o@0.1").config.budget == 0.1
    for bad in ("h2o", "full@0.2", "h2o@1.5", "h2o@-1+4", "bogus@0.2"):
        with pytest.raises(ValueError, match="--policies"):
            Setting.parse(bad)


def test_decode_step_is_timed_only_while_every_request_decodes():
    # two requests: A starts at 0 (first token at 1.0, then 0.1 s steps), B's prefill delays the batch: B's first
    # token at 2.0; after that both decode in 0.2 s steps. Only gaps inside [2.0, min(last)] count.
    a_gaps = [0.5, 0.5] + [0.2] * 10  # A: 1.0, 1.5, 2.0, 2.2, ..., 4.0
    b_gaps = [0.2] * 8  # B: 2.0, 2.2, ..., 3.6
    detail = {"start_times": [0.0, 0.5], "ttfts": [1.0, 1.5], "itls": [a_gaps, b_gaps]}
    step = steady_step_ms(detail)
    assert step["p50"] == pytest.approx(200.0) and step["mean"] == pytest.approx(200.0)
    assert step["window_s"] == pytest.approx(1.6) and step["requests"] == 2
    assert steady_step_ms({"start_times": [0.0], "ttfts": [1.0], "itls": [[0.1] * 5]}) is None  # one request


def _row(key, outcome, **extra):
    return {"key": key, "id": f"chatcmpl-{key}", "outcome": outcome, "max_tokens": 8, **extra}


def test_accounting_catches_a_lost_or_duplicated_request():
    rows = [_row("a", "completed", completion_tokens=8), _row("b", "disconnected"),
            _row("c", "error", status=400, error="bad"), _row("d", "error", status=None, error="reset")]  # fmt: skip
    fine = {"http_2xx": 2, "http_4xx": 1, "http_5xx": 0, "engine_finished": 1}
    assert check_outcomes(rows, fine)["none_lost_or_duplicated"]
    assert check_outcomes(rows, {**fine, "engine_finished": 2})["none_lost_or_duplicated"]  # b finished first
    assert not check_outcomes(rows, {**fine, "http_2xx": 3})["none_lost_or_duplicated"]  # a retry/duplicate
    assert not check_outcomes(rows, {**fine, "engine_finished": 0})["none_lost_or_duplicated"]  # a lost one
    assert not check_outcomes(rows, {**fine, "engine_finished": 3})["none_lost_or_duplicated"]
    duplicate_ids = rows + [{**_row("e", "completed"), "id": "chatcmpl-a"}]
    assert not check_outcomes(duplicate_ids, {**fine, "http_2xx": 3, "engine_finished": 2})["unique_response_ids"]


def test_soak_config_names_a_bad_option():
    for kwargs, name in (
        (dict(clients=0), "--clients"),
        (dict(duration_s=0), "--duration"),
        (dict(disconnect_fraction=1.5), "--disconnect-fraction"),
        (dict(max_tokens=(9, 3)), "range"),
    ):
        with pytest.raises(ValueError, match=name):
            SoakConfig(**kwargs)


def test_comparison_table_ratios_against_the_first_setting():
    def result(label, tok_s):
        return {"setting": label, "metrics": {"output_throughput": tok_s, "request_throughput": 0.1},
                "max_running": 4, "preemptions": 0, "peak_rss_bytes": 2**31}  # fmt: skip

    table = comparison_table([result("full", 20.0), result("h2o@0.2", 70.0)]).splitlines()
    assert table[0].startswith("| setting | backend |")
    assert "| 3.50x |" in table[3] and "| 1.00x |" in table[2]
