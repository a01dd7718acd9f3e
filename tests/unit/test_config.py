"""EngineArgs -> EngineConfig validation: every bad value names its argument."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from tidal.launch.engine_args import EngineArgs


def _cfg(path: str, **kw):
    return EngineArgs(model=path, **kw).create_engine_config()


def test_defaults_resolve(qwen3_ckpt):
    cfg = _cfg(qwen3_ckpt)
    assert cfg.model.architecture == "Qwen3MoeForCausalLM"
    assert cfg.model.dtype == "float32"
    assert cfg.model.max_model_len == 512  # the checkpoint's max_position_embeddings
    assert cfg.scheduler.max_model_len == cfg.model.max_model_len
    assert cfg.parallel.data_parallel_size == 1 and cfg.parallel.ep_size == 1
    assert cfg.model.eos_token_ids  # from config.json / generation_config.json


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float", "float32")])
def test_vllms_dtype_names_are_taken(qwen3_ckpt, given, dtype):
    assert _cfg(qwen3_ckpt, dtype=given).model.dtype == dtype


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"block_size": 3}, "block_size"),
        ({"max_model_len": 100000}, "max_model_len"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"dtype": "float64"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "max_num_batched_tokens"),
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank"),
        ({"all2all_backend": "carrier-pigeon"}, "all2all_backend"),
        ({"enable_eplb": True}, "enable_eplb"),
        ({"num_redundant_experts": -1}, "num_redundant_experts"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"moe_backend": "magic"}, "moe_backend"),
        ({"dp_lb_policy": "random"}, "dp_lb_policy"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_bad_values_name_the_field(qwen3_ckpt, kwargs, field):
    with pytest.raises(ValueError, match=field):
        _cfg(qwen3_ckpt, **kwargs)


def test_missing_model_dir():
    with pytest.raises(ValueError, match="model"):
        _cfg("/nonexistent/checkpoint")


def test_unknown_architecture(qwen3_ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(os.path.join(qwen3_ckpt, "config.json")) as f:
        conf = json.load(f)
    conf["architectures"] = ["LlamaForCausalLM"]
    conf["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        _cfg(str(bad))


def test_config_hash_ignores_the_live_dp_size(qwen3_ckpt, qwen3_long_ckpt, tmp_path):
    """docs/architecture.md#elastic-identity: the hash a joining engine checks covers what must match (model,
    dtype, EP, backends, block size), never the live DP size, a rank or the model's path."""
    base = _cfg(qwen3_ckpt, data_parallel_size=2, enable_expert_parallel=True)
    grown = _cfg(
        qwen3_ckpt, data_parallel_size=3, data_parallel_rank=2, enable_expert_parallel=True
    )
    assert base.parallel.config_hash() == grown.parallel.config_hash()
    assert base.config_hash() == grown.config_hash()
    assert base.config_hash() == base.with_parallel(data_parallel_size=5).config_hash()
    moved = tmp_path / "elsewhere"
    shutil.copytree(qwen3_ckpt, moved)  # same checkpoint, another host's path
    assert _cfg(str(moved), data_parallel_size=2, enable_expert_parallel=True).config_hash() == (
        base.config_hash()
    )
    different = [
        _cfg(qwen3_ckpt, data_parallel_size=2),  # EP off
        _cfg(
            qwen3_ckpt, data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all2all"
        ),
        _cfg(qwen3_ckpt, data_parallel_size=2, enable_expert_parallel=True, dtype="bfloat16"),
        _cfg(qwen3_ckpt, data_parallel_size=2, enable_expert_parallel=True, block_size=32),
        _cfg(qwen3_ckpt, data_parallel_size=2, enable_expert_parallel=True, moe_backend="torch"),
        _cfg(qwen3_long_ckpt, data_parallel_size=2, enable_expert_parallel=True),  # model
    ]
    hashes = {c.config_hash() for c in different} | {base.config_hash()}
    assert len(hashes) == len(different) + 1


def test_parallel_hash_ignores_rank_fields(qwen3_ckpt):
    a = _cfg(qwen3_ckpt, data_parallel_size=2, data_parallel_rank=0).parallel
    b = _cfg(qwen3_ckpt, data_parallel_size=2, data_parallel_rank=1).parallel
    c = _cfg(qwen3_ckpt, data_parallel_size=2, enable_expert_parallel=True).parallel
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_kv_cache_too_small_is_clear(qwen3_ckpt):
    from tidal import LLM, SamplingParams

    with pytest.raises(ValueError, match="max_model_len"):
        LLM(qwen3_ckpt, multiprocess=False, num_gpu_blocks_override=4, block_size=4)
    # 4 x 4 = max_model_len tokens, but block 0 is never handed out: refused at start, not
    # request by request later. One block more serves a full-length request.
    kw = {"multiprocess": False, "block_size": 4, "max_model_len": 16}
    with pytest.raises(ValueError, match="one block reserved"):
        LLM(qwen3_ckpt, num_gpu_blocks_override=4, **kw)
    with LLM(qwen3_ckpt, num_gpu_blocks_override=5, **kw) as llm:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 12


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_cli_error_names_the_flag(qwen3_ckpt):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tidal.launch.cli",
            "serve",
            "--model",
            qwen3_ckpt,
            "--block-size",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--block-size" in r.stderr


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        # 4 query heads, 2 KV heads, expert intermediate 32 (tests/conftest.py's model).
        (
            {"tensor_parallel_size": 3},
            r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)",
        ),
        ({"tensor_parallel_size": 4}, r"num_key_value_heads \(2\) is not divisible"),
        (
            {"tensor_parallel_size": 2, "data_parallel_size": 5, "enable_expert_parallel": True},
            "makes 10 expert-parallel workers for 8 experts",
        ),
    ],
)
def test_tensor_parallel_sizes_the_model_cannot_shard(qwen3_ckpt, kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        _cfg(qwen3_ckpt, **kwargs)
    assert str(e.value).startswith("tensor_parallel_size")  # the CLI names -tp's flag


def test_experts_whose_intermediate_does_not_divide(tmp_path):
    from tidal.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        str(tmp_path / "odd"), "qwen3_moe", hidden_size=64, num_heads=4, num_kv_heads=4,
        moe_intermediate_size=30, vocab_size=300, max_position_embeddings=128,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\) is not divisible"):
        _cfg(path, tensor_parallel_size=4)
    # With EP the experts stay whole: only the heads must divide.
    assert _cfg(path, tensor_parallel_size=2, enable_expert_parallel=True)


def test_tensor_parallel_size_is_in_the_config_hash_and_device_slots_are_not(qwen3_ckpt):
    a = _cfg(qwen3_ckpt).parallel
    b = _cfg(qwen3_ckpt, tensor_parallel_size=2).parallel
    assert a.config_hash() != b.config_hash()
    assert b.config_hash() == dataclasses.replace(b, device_ids=(3, 4)).config_hash()


def test_the_cli_takes_tp_and_cpu_kernels_together(qwen3_ckpt, capsys):
    """``-tp`` (issue 21) and ``--cpu-kernels`` (issue 25) on one command line: both reach
    the engine config, and a bad path is a CLI error naming its flag."""
    import argparse

    from tidal.launch.args import add_engine_args, build_engine_config

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    ns = parser.parse_args(["--model", qwen3_ckpt, "-tp", "2", "--cpu-kernels", "onednn"])
    cfg = build_engine_config(parser, ns)
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.cpu_kernels == "onednn"
    bad = parser.parse_args(["--model", qwen3_ckpt, "-tp", "2", "--cpu-kernels", "fast"])
    with pytest.raises(SystemExit):
        build_engine_config(parser, bad)
    assert "--cpu-kernels: cpu_kernels must be one of" in capsys.readouterr().err


def test_cpu_affinity_flag(qwen3_ckpt, capsys):
    """``--cpu-affinity`` reaches the parallel config (the launcher assigns each rank's
    cores, never the flag parser); a bad value is a CLI error naming the flag."""
    import argparse

    from tidal.launch.args import add_engine_args, build_engine_config

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    cfg = build_engine_config(parser, parser.parse_args(["--model", qwen3_ckpt]))
    assert cfg.parallel.cpu_affinity == "auto" and cfg.parallel.cpu_cores == ()
    ns = parser.parse_args(["--model", qwen3_ckpt, "--cpu-affinity", "0|1"])
    assert build_engine_config(parser, ns).parallel.cpu_affinity == "0|1"
    bad = parser.parse_args(["--model", qwen3_ckpt, "--cpu-affinity", "0-1|1"])
    with pytest.raises(SystemExit):
        build_engine_config(parser, bad)
    assert "--cpu-affinity: cpu_affinity: groups overlap" in capsys.readouterr().err
    # This host's ranks need their groups here: a core outside this process's mask.
    outside = max(os.sched_getaffinity(0)) + 1
    bad = parser.parse_args(["--model", qwen3_ckpt, "--dp", "2", "--cpu-affinity", f"0|{outside}"])
    with pytest.raises(SystemExit):
        build_engine_config(parser, bad)
    assert f"--cpu-affinity: cpu_affinity: cores [{outside}] are not usable" in (
        capsys.readouterr().err
    )


def _with_generation_config(src: str, dst, config: dict) -> str:
    """A copy of checkpoint ``src`` (links to its files) with this generation_config.json."""
    import json
    import os

    dst.mkdir()
    for name in os.listdir(src):
        if name != "generation_config.json":
            os.symlink(os.path.join(src, name), dst / name)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return str(dst)


QWEN3_STYLE = {
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "eos_token_id": [2, 7],
}


def test_sampling_defaults_come_from_generation_config(qwen3_ckpt, tmp_path):
    """--generation-config auto (the default) reads the checkpoint's recommended sampling
    values, as vLLM does; values equal to transformers' own defaults recommend nothing;
    none ignores them; a folder holding a generation_config.json replaces them."""
    from tidal.launch.engine_args import sampling_defaults

    model = _with_generation_config(
        qwen3_ckpt, tmp_path / "m", {**QWEN3_STYLE, "max_new_tokens": 9}
    )
    cfg = _cfg(model)
    assert cfg.model.sampling_defaults == (
        ("max_tokens", 9), ("temperature", 0.6), ("top_k", 20), ("top_p", 0.95),
    )  # fmt: skip
    assert cfg.model.generation_eos_token_ids == (2, 7)  # still read, whatever the flag
    assert _cfg(model, generation_config="none").model.sampling_defaults == ()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"min_p": 0.1, "repetition_penalty": 1.1}')
    got = _cfg(model, generation_config=str(other)).model.sampling_defaults
    assert got == (("min_p", 0.1), ("repetition_penalty", 1.1))
    assert sampling_defaults({"temperature": 1.0, "top_k": 50, "top_p": 1.0}, "x") == ()
    with pytest.raises(ValueError, match=r"^generation_config: .*not a directory"):
        _cfg(model, generation_config=str(tmp_path / "missing"))
    bad = _with_generation_config(qwen3_ckpt, tmp_path / "bad", {"temperature": -1})
    with pytest.raises(ValueError, match=r"^generation_config: .*bad/generation_config.json: "):
        _cfg(bad)


def test_llm_without_sampling_params_uses_the_recommendation(qwen3_ckpt, tmp_path):
    from tidal import LLM

    model = _with_generation_config(
        qwen3_ckpt, tmp_path / "m", {**QWEN3_STYLE, "max_new_tokens": 3}
    )
    with LLM(model, multiprocess=False, dtype="float32") as llm:
        default = llm.get_default_sampling_params()
        assert (default.temperature, default.top_k, default.top_p) == (0.6, 20, 0.95)
        seen = []
        check = llm.input_processor.check
        llm.input_processor.check = lambda prompt, params: (
            seen.append(params),
            check(prompt, params),
        )
        (out,) = llm.generate("The tide", use_tqdm=False)
        assert seen[0].temperature == 0.6 and seen[0].max_tokens == 3
        assert 1 <= len(out.outputs[0].token_ids) <= 3
