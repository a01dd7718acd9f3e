"""benchmarks/cpu_speed.py without engines: medians over rounds (booleans must hold in
every round) and the vLLM environment taken from env_vllm.sh."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_speed.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cpu_speed", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_cpu_speed"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_median_rows(bench):
    rows = [
        {"single": 10.0, "batch": 100.0, "single_identical": True, "ready_s": 3.0},
        {"single": 30.0, "batch": 90.0, "single_identical": False, "ready_s": None},
        {"single": 20.0, "batch": 95.0, "single_identical": True, "ready_s": 5.0},
    ]
    out = bench._median_rows(rows)
    assert out == {
        "single": 20.0,
        "batch": 95.0,
        "single_identical": False,  # identical only if identical in every round
        "ready_s": 4.0,  # the rounds that have it
        "rounds": 3,
    }


def test_paired_ratio_compares_within_each_round(bench):
    """The default against the best own path of the same round, then the median: a round
    where the whole machine was slow moves both sides, not the ratio."""
    rows = {
        "tidal_auto": [{"single": 100.0, "batch": 50.0}, {"single": 60.0, "batch": 30.0}],
        "tidal_native": [{"single": 110.0, "batch": 50.0}, {"single": 55.0, "batch": 33.0}],
        "tidal_torch": [{"single": 40.0, "batch": 20.0}, {"single": 20.0, "batch": None}],
    }
    out = bench._paired_ratio(rows, ["tidal_auto", "tidal_native", "tidal_torch"])
    assert out["single_per_round"] == [round(100 / 110, 3), 1.0]
    assert out["batch_per_round"] == [1.0, round(30 / 33, 3)]
    assert out["single"] == round((100 / 110 + 1.0) / 2, 3)


def test_vllm_env_drops_a_missing_preload(bench, tmp_path):
    env = bench._vllm_env(tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))
    assert all(pathlib.Path(p).exists() for p in env["LD_PRELOAD"].split(":") if p)


def test_peer_runs_in_a_private_temp_dir_removed_after(bench, tmp_path):
    """What a peer leaves in its temp directory (vLLM: ipc:// socket files) goes with it."""
    script = (
        "import json, os, sys, tempfile; d = tempfile.gettempdir();"
        "open(os.path.join(d, 'left-behind'), 'w').close();"
        "json.dump({'tmp': d}, open(sys.argv[1], 'w'))"
    )
    out = tmp_path / "out.json"
    got = bench._run_json([sys.executable, "-c", script, str(out)], out)
    tmp = pathlib.Path(got["tmp"])
    assert tmp.name.startswith("cpu-speed-") and not tmp.exists()


def test_layer_flops_match_transformers_flop_count(bench):
    """The roofline's FLOPs per token equal what torch's FlopCounterMode counts in
    transformers' own Qwen3-MoE (eager attention and experts: every product is an mm or
    bmm it counts), the lm_head on every position added, context = the whole sequence."""
    import json

    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    tokens = 12
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 256, (1, tokens)))
    c = json.loads(cfg.to_json_string())  # the checkpoint's config.json keys
    lm_head = 2 * c["vocab_size"] * c["hidden_size"]
    assert counter.get_total_flops() == tokens * (bench.layer_flops_per_token(c, tokens) + lm_head)


def test_active_bytes_are_the_weights_one_decode_token_reads(bench):
    """Batch-1 decode bytes at bf16: transformers' own attention projections, router,
    top-k of its experts (per-expert size from the fused tensors) and lm_head, 2 bytes each."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    sd = Qwen3MoeForCausalLM(cfg).state_dict()
    c = json.loads(cfg.to_json_string())

    def numel(part: str) -> int:
        return sum(v.numel() for k, v in sd.items() if part in k)

    attn = sum(numel(f"self_attn.{p}_proj.weight") for p in "qkvo")
    per_expert = numel("mlp.experts.") // (c["num_hidden_layers"] * c["num_local_experts"])
    active = attn + numel("mlp.gate.weight") + numel("lm_head.weight")
    active += c["num_hidden_layers"] * c["num_experts_per_tok"] * per_expert
    assert bench.active_bytes_per_token(c, 2) == 2 * active


def test_dtype_goals_from_one_run(bench, tmp_path):
    """The reduced-precision goals read this run's sections: decode bytes x single tok/s
    against the read bandwidth, agreement against vLLM's, the rank's memory."""
    cfg = {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "vocab_size": 256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    per_token = bench.active_bytes_per_token(cfg, 2)
    single = 0.8e9 / per_token  # 0.8 GB/s of weights read at batch 1
    doc = {
        "roofline": {"read_bandwidth_gb_s": 1.0},
        "e2e": {"big": {"engines": {"tidal_auto": {"single": single}},
                        "goals": {"vllm_batch_ge_1.2x": False, "not_slower_x": True}}},
        "agreement": {"big": {"goals": {"tidal_agrees_at_least_as_often_as_vllm": True}}},
        "memory": {"big": {"rank_process": {"rss_over_ckpt_plus_kv": 1.3,
                                            "above_runtime_over_ckpt_plus_kv": 1.1}}},
    }  # fmt: skip
    opts = type("Opts", (), {"engine_dtype": "bfloat16"})()
    g = bench.dtype_goals(doc, {"big": tmp_path}, opts)["big"]
    assert g["single_fraction_of_bandwidth"] == 0.8
    assert g["decode_batch1_ge_75pct_bandwidth"] is True
    assert g["agreement_tidal_ge_vllm"] is True
    assert g["rank_rss_le_1.15x_weights_plus_kv"] is False
    assert g["rank_above_runtime_le_1.15x_weights_plus_kv"] is True
    assert g["vllm_batch_ge_1.2x"] is False and "not_slower_x" not in g


def test_fp8_checkpoints_quantize_the_bf16_cast_and_dequantize_it(bench, tmp_path):
    """The FP8 run's checkpoints: the peer one's bf16 cast in FP8 blocks with their
    scales, and the bf16 checkpoint of exactly the FP8 values (what the peers run)."""
    from safetensors.torch import load_file

    from tidal.kernels.fp8_torch import dequantize_fp8_blocks
    from tidal.models.tiny import make_tiny_checkpoint

    src = tmp_path / "peer"
    make_tiny_checkpoint(str(src), hidden_size=32, num_layers=1, num_experts=4, vocab_size=300)
    fp8, deq = bench.fp8_checkpoints(src)
    q, d = load_file(str(fp8 / "model.safetensors")), load_file(str(deq / "model.safetensors"))
    name = next(n for n in q if n.endswith("experts.0.gate_proj.weight"))
    assert q[name].dtype == torch.float8_e4m3fn and f"{name}_scale_inv" in q
    want = dequantize_fp8_blocks(q[name], q[f"{name}_scale_inv"], (128, 128)).bfloat16()
    assert d[name].dtype == torch.bfloat16 and torch.equal(d[name], want)
    assert (
        json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"]
        == "fp8"
    )
    assert bench.fp8_checkpoints(src) == (fp8, deq)  # built once


def test_choices_come_from_the_runs_report_when_the_trials_were_not_cached(bench, tmp_path):
    """An oversubscribed machine keeps no trial cache: the choices are then what the newest
    run reported serving, not an empty section."""
    cache = tmp_path / "kernels"
    cache.mkdir()
    op = {"decode": "native:t0", "batch": "torch", "layout": "native", "source": "measured",
          "timings_ms": {"decode": {"native:t0": 0.01, "torch": 0.02},
                         "batch": {"native:t0": 0.05, "torch": 0.04}}}  # fmt: skip
    old, new = tmp_path / "tidal_tiny_auto_r0.json", tmp_path / "tidal_tiny_auto_r1.json"
    old.write_text(json.dumps({"cpu_kernels": [{"cpu": "old", "ops": {}}]}))
    new.write_text(json.dumps({"cpu_kernels": [{"cpu": "X", "ops": {"linear[8x8x0]": op}}]}))
    os.utime(old, (old.stat().st_mtime - 10, old.stat().st_mtime - 10))  # the older run
    got = bench._choices(cache, [old, new])
    assert got["linear[8x8x0]"]["decode"] == "native:t0"
    assert got["linear[8x8x0]"]["batch"] == "torch"
    assert got["_cpu"] == "X" and "not cached" in got["_source"]
    assert bench._choices(cache, []) == {}
