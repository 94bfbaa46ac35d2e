"""What of ``scripts/gpu_check.sh`` a CPU can check: the script parses, and its benchmark model has Llama-3-8B's
shapes with room for 16k-token prompts (built on the meta device: no 8B parameters are allocated)."""

from __future__ import annotations

import pathlib
import subprocess

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from h2o_kv.bench.cli import _model_positions
from h2o_kv.bench.workload import RANDOM_SHAPES

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_gpu_check_parses_and_names_its_options():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    bad = subprocess.run(["bash", str(SCRIPT), "--nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument --nope" in bad.stderr


def test_random_llama31_8b_has_llama3_8b_shapes_and_a_long_context():
    spec = dict(RANDOM_SHAPES["llama3.1-8b"])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.03  # Llama-3-8B's parameter count
    same = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert all(RANDOM_SHAPES["llama3-8b"][key] == spec[key] for key in same)
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # bf16 K+V
    assert kv_bytes_per_token == 128 * 2**10
    assert _model_positions("random:llama3.1-8b") == 131072 > 16384 + 64  # gpu_check's longest prompt fits
    assert _model_positions("random:llama3-8b") == 8192  # which is why the script does not use it
