"""Tuned-config lookup (pure) and the tuning script's search/write path on the interpreter."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tidal.kernels.moe_config import (
    CONFIG_DIR,
    MoeKernelConfig,
    config_file_name,
    default_config,
    default_linear_config,
    dump_config_file,
    get_linear_config,
    get_moe_config,
    linear_config_file_name,
    load_linear_configs,
    load_tuned_configs,
    nearest_config,
    parse_config_file,
)

TUNE_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_moe.py"


def _cfg(block_m: int) -> MoeKernelConfig:
    return MoeKernelConfig(block_m, 64, 64, group_size_m=8, num_warps=4, num_stages=3)


def test_file_name_follows_vllm_style():
    name = config_file_name(16, 256, "NVIDIA H100 80GB HBM3", torch.bfloat16)
    assert name == "E=16,N=256,device_name=NVIDIA_H100_80GB_HBM3,dtype=bfloat16.json"


def test_json_round_trip_and_keys():
    table = {1: _cfg(16), 256: _cfg(64)}
    text = dump_config_file(table)
    assert json.loads(text)["256"]["BLOCK_SIZE_M"] == 64
    assert set(json.loads(text)["1"]) == {
        "BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"
    }  # fmt: skip
    assert parse_config_file(text) == table


@pytest.mark.parametrize(
    "bad",
    [
        '{"1": {"BLOCK_SIZE_M": 12, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64}}',
        '{"1": {"BLOCK_M": 16}}',
        "{}",
        "[]",
    ],
)
def test_parse_rejects_malformed(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_config_file(bad)


def test_nearest_batch_size():
    table = {1: _cfg(16), 64: _cfg(32), 1024: _cfg(64)}
    assert nearest_config(table, 1) == _cfg(16)
    assert nearest_config(table, 30) == _cfg(16)  # |30 - 1| < |30 - 64|
    assert nearest_config(table, 40) == _cfg(32)
    assert nearest_config(table, 500) == _cfg(32)
    assert nearest_config(table, 600) == _cfg(64)
    assert nearest_config(table, 100000) == _cfg(64)


def test_lookup_uses_matching_file_only(tmp_path):
    (tmp_path / config_file_name(8, 128, "Fake GPU", "float16")).write_text(
        dump_config_file({1: _cfg(16), 512: _cfg(128)})
    )
    kwargs = dict(num_experts=8, intermediate_size=128, top_k=2, config_dir=tmp_path)
    got = get_moe_config(
        400, dtype=torch.float16, device_name="Fake GPU", interpret=False, **kwargs
    )
    assert got == _cfg(128)
    # Other dtype / device / interpreter: no file, so the batch-aware default.
    for dtype, name, interp in ((torch.bfloat16, "Fake GPU", False), (torch.float16, "Other", False),
                                (torch.float16, "Fake GPU", True)):  # fmt: skip
        got = get_moe_config(400, dtype=dtype, device_name=name, interpret=interp, **kwargs)
        assert got == default_config(400, 8, 2, interp)


def test_default_config_is_batch_aware():
    decode = default_config(4, 64, 8, interpret=False)
    prefill = default_config(8192, 64, 8, interpret=False)
    assert decode.block_size_m == 16
    assert prefill.block_size_m > decode.block_size_m
    assert prefill.group_size_m > 1
    assert default_config(8192, 64, 8, interpret=True).block_size_m == 16


def test_shipped_config_files_parse():
    for path in CONFIG_DIR.glob("*.json"):
        assert parse_config_file(path.read_text()), path


def test_shipped_h200_table_is_found_by_the_device_name_torch_reports():
    """The H200 table (benchmarks/gpu_proof.sh) under the name torch.cuda gives that GPU,
    at the experts and width of the layer it was swept on; other shapes keep the default."""
    table = parse_config_file(
        (CONFIG_DIR / "E=128,N=768,device_name=NVIDIA_H200,dtype=bfloat16.json").read_text()
    )
    for m, want in ((1, table[1]), (3, table[1]), (200, table[256]), (4096, table[2048])):
        got = get_moe_config(m, 128, 768, 8, torch.bfloat16, "NVIDIA H200", interpret=False)
        assert got == want, m
    other = get_moe_config(1, 64, 768, 8, torch.bfloat16, "NVIDIA H200", interpret=False)
    assert other == default_config(1, 64, 8, interpret=False)


def test_shipped_h200_fp8_tables_are_found_for_their_layers():
    """The H200 FP8 tables (``STEPS="facts fp8" benchmarks/gpu_proof.sh``): the fused MoE's
    at Qwen3-30B-A3B's and DeepSeek-V3's layers, the linear's at DeepSeek-V3's o_proj with
    its decode entry splitting k; bf16 keeps its own table."""
    fp8 = torch.float8_e4m3fn
    for experts, inter in ((128, 768), (256, 2048)):
        name = f"E={experts},N={inter},device_name=NVIDIA_H200,dtype=float8_e4m3fn.json"
        table = parse_config_file((CONFIG_DIR / name).read_text())
        for m, want in ((1, table[1]), (40, table[64]), (3000, table[2048])):
            assert get_moe_config(m, experts, inter, 8, fp8, "NVIDIA H200", False) == want
    bf16 = get_moe_config(1, 128, 768, 8, torch.bfloat16, "NVIDIA H200", False)
    assert bf16 != get_moe_config(1, 128, 768, 8, fp8, "NVIDIA H200", False)
    load_linear_configs.cache_clear()
    one_row = get_linear_config(1, 7168, 16384, fp8, "NVIDIA H200", False)
    assert one_row.split_k > 1 and one_row.block_size_k == 128


def test_config_validation():
    with pytest.raises(ValueError):
        MoeKernelConfig(24, 64, 64)
    with pytest.raises(ValueError):
        MoeKernelConfig(16, 8, 64)
    with pytest.raises(ValueError):
        MoeKernelConfig(16, 64, 64, group_size_m=0)
    with pytest.raises(ValueError):
        MoeKernelConfig(16, 64, 64, split_k=0)
    with pytest.raises(ValueError, match="unknown"):
        MoeKernelConfig.from_json({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64,
                                   "SPLIT": 2})  # fmt: skip


def test_the_fused_moe_takes_no_split_k(tmp_path):
    """``split_k`` is the FP8 linear's: a fused-MoE table holding it is a load error naming
    the file, an explicit config holding it a ValueError before any launch."""
    from tidal.kernels.fused_moe import fused_experts_with_config

    name = config_file_name(4, 16, "NVIDIA H200", "bfloat16")
    split = MoeKernelConfig(16, 32, 32, split_k=2)
    (tmp_path / name).write_text(dump_config_file({1: split}))
    load_tuned_configs.cache_clear()
    with pytest.raises(ValueError, match=f"malformed MoE config file .*{name}.*split_k"):
        load_tuned_configs(4, 16, "NVIDIA H200", "bfloat16", tmp_path)
    x, w13, w2 = torch.randn(2, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    tw, ids = torch.rand(2, 2), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="split_k must be 1"):
        fused_experts_with_config(x, w13, w2, tw, ids, None, True, split)


def test_split_k_is_written_only_where_it_is_not_one():
    """Tables without split-K (every fused-MoE table) read and write as before."""
    plain, split = MoeKernelConfig(16, 64, 128), MoeKernelConfig(16, 64, 128, split_k=4)
    assert "SPLIT_K" not in plain.to_json() and split.to_json()["SPLIT_K"] == 4
    assert parse_config_file(dump_config_file({1: split, 64: plain})) == {1: split, 64: plain}


def test_tune_script_search_and_write(tmp_path, device):
    """One batch size through the script's search, check and merge-write path."""
    spec = importlib.util.spec_from_file_location("tune_moe", TUNE_SCRIPT)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    args = tune.parse_args(["--interpret-smoke", "--dtype", "float32", "--out-dir", str(tmp_path)])
    assert (args.num_experts, args.hidden_size, args.intermediate_size) == (4, 32, 16)
    args.iters = 1
    best, best_us, default_us, rejected = tune.tune_one(args, 5, device, tune.smoke_configs())
    assert best in tune.smoke_configs() and rejected == 0 and best_us > 0 and default_us > 0
    path = tmp_path / config_file_name(4, 16, "interpreter", "float32")
    path.write_text(dump_config_file({1: _cfg(16)}))
    tune.write_table(path, {5: best})
    load_tuned_configs.cache_clear()
    table = load_tuned_configs(4, 16, "interpreter", "float32", tmp_path)
    assert table == {1: _cfg(16), 5: MoeKernelConfig.from_json(best)}


def test_tune_script_fp8_writes_the_float8_table(tmp_path, capsys):
    """``--dtype fp8``: the block-FP8 kernel searched against its w8a8 reference, the
    table written under dtype float8_e4m3fn and found there by the FP8 lookup."""
    if torch.cuda.is_available():
        pytest.skip("--interpret-smoke is the CPU's rehearsal; a GPU runs the script itself")
    spec = importlib.util.spec_from_file_location("tune_moe", TUNE_SCRIPT)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    argv = ["--interpret-smoke", "--dtype", "fp8", "--batch-sizes", "3", "--out-dir", str(tmp_path)]
    assert tune.main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["dtype"] == "fp8" and line["rejected"] == 0 and line["M"] == 3
    load_tuned_configs.cache_clear()
    table = load_tuned_configs(4, 16, "interpreter", "float8_e4m3fn", tmp_path)
    assert table == {3: MoeKernelConfig.from_json(line["config"])}
    fp8 = tune.candidate_configs("full", 64, 8, 2, max_block_k=128)
    assert fp8 and max(c["BLOCK_SIZE_K"] for c in fp8) == 128


def test_fp8_default_config_takes_whole_weight_blocks():
    for m in (1, 64, 4096):
        fp8 = default_config(m, 64, 8, interpret=False, dtype=torch.float8_e4m3fn)
        assert fp8.block_size_k == 128
        assert fp8.block_size_m == default_config(m, 64, 8, interpret=False).block_size_m
    assert default_config(1, 64, 8, interpret=True, dtype="float8_e4m3fn").block_size_k == 32


def test_fp8_linear_lookup(tmp_path):
    """The FP8 linear's table: found for its [N, K], device and dtype only; nearest rows."""
    name = linear_config_file_name(7168, 16384, "NVIDIA H200", torch.float8_e4m3fn)
    assert name == "linear,N=7168,K=16384,device_name=NVIDIA_H200,dtype=float8_e4m3fn.json"
    (tmp_path / name).write_text(dump_config_file({1: _cfg(16), 256: _cfg(64)}))
    load_linear_configs.cache_clear()

    def get(m, n=7168, device="NVIDIA H200", interpret=False):
        return get_linear_config(m, n, 16384, "float8_e4m3fn", device, interpret, tmp_path)

    assert get(3) == _cfg(16) and get(200) == _cfg(64)
    assert get(3, n=4096) == default_linear_config(3, False)  # another shape
    assert get(3, device="NVIDIA H100") == default_linear_config(3, False)
    assert get(3, interpret=True) == default_linear_config(3, True)
    assert default_linear_config(1, False).block_size_k == 128


def test_tune_candidates_prune_big_blocks_for_decode():
    spec = importlib.util.spec_from_file_location("tune_moe", TUNE_SCRIPT)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    decode = tune.candidate_configs("small", 1, 64, 8)
    prefill = tune.candidate_configs("small", 4096, 64, 8)
    assert decode and max(c["BLOCK_SIZE_M"] for c in decode) == 16
    assert max(c["BLOCK_SIZE_M"] for c in prefill) == 128
    assert all(MoeKernelConfig.from_json(c) for c in prefill)
    assert isinstance(tune.parse_args([]), argparse.Namespace)


def test_config_for_is_the_lookup_once_per_shape():
    """``fused_experts``' config: ``get_moe_config``'s answer, looked up once per shape."""
    from tidal.kernels.fused_moe import config_for, is_interpreted

    config_for.cache_clear()
    for m in (1, 3, 64, 1000):
        want = get_moe_config(m, 8, 32, 2, torch.float32, None, interpret=is_interpreted())
        assert config_for(m, 8, 32, 2, torch.float32, torch.device("cpu")) == want
    config_for(3, 8, 32, 2, torch.float32, torch.device("cpu"))
    info = config_for.cache_info()
    assert (info.hits, info.misses) == (1, 4)
