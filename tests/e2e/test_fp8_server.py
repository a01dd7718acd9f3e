"""Elastic EP on the architectures whose experts carry more than two weights:
``--dp 2 --ep --enable-elastic-ep`` scaled 2 -> 3 -> 2 under streaming load.

- An FP8 checkpoint (DeepSeek-V3's layout, ``make_tiny_fp8_checkpoint``): the experts
  move with their row scales (``--cpu-kernels native``: the C++ FP8 kernels serve; each
  engine start times only their prefetch hints).
- GPT-OSS (the tiny checkpoint: alternating sliding layers, sinks, YaRN): the experts
  move with their biases; the clamped SwiGLU's alpha and limit are the layer's
  (``--cpu-kernels native``: the C++ fused MoE with the biases serves, so an install
  re-packs the moved experts and the kernel reads the moved biases).

The joining engine gets its experts from its peers (expert transfers), the scale-down
moves the leaving engine's back; every stream completes and equals its greedy reference
from before the scaling (float32 activations, so batches do not change a token)."""

from __future__ import annotations

import subprocess

import httpx
import psutil
import pytest

from tests.e2e.server_utils import StreamingLoad, stream_completion
from tests.e2e.test_elastic_server import AUTH, KeyedServer, _record, _scale_cmd
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The tide comes in", "Experts route tokens", "A ship sails at dawn"]
MAX_TOKENS = 16


@pytest.fixture(params=["deepseek_v3_fp8", "gpt_oss"])
def ckpt_and_kernels(request, tiny_ckpt) -> tuple[str, str]:
    if request.param == "gpt_oss":
        return tiny_ckpt("gpt_oss"), "native"
    return request.getfixturevalue("deepseek_fp8_ckpt"), "native"


def test_experts_with_extra_tensors_scale_2_3_2_under_load(ckpt_and_kernels):
    ckpt, kernels = ckpt_and_kernels
    srv = KeyedServer(
        [
            "--model", ckpt, "--dp", "2", "--ep", "--enable-elastic-ep",
            "--dtype", "float32", "--max-model-len", "256", "--cpu-kernels", kernels,
            "--log-level", "warning",
        ]
    )  # fmt: skip
    seen: dict[int, psutil.Process] = {p.pid: p for p in srv.children}
    load: StreamingLoad | None = None
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as client:
            refs = {i: stream_completion(client, p, MAX_TOKENS) for i, p in enumerate(PROMPTS)}
        assert all(r.completion_tokens == MAX_TOKENS for r in refs.values()), refs
        load = StreamingLoad(srv.url, PROMPTS, MAX_TOKENS, AUTH, timeout_s=120)
        assert wait_until(lambda: load.served() > 10 or bool(load.errors), 120), "no load"
        for size, joining, leaving in ((3, [2], []), (2, [], [2])):
            done = subprocess.run(
                _scale_cmd(srv.url, size), capture_output=True, text=True, timeout=240
            )
            rec = _record(done.stdout, done.stderr, done.returncode, srv)
            assert (rec["result"], rec["to_size"]) == ("succeeded", size), rec
            assert (rec["joining"], rec["leaving"]) == (joining, leaving), rec
            # The plan's bytes are what the transfers measured moving: FP8 weights with
            # their scales, or the biases beside the weights (not the model dtype's size).
            assert rec["experts_moved"] > 0 and rec["disk_bytes"] == 0, rec
            assert rec["bytes_received"] == rec["p2p_bytes"] == rec["bytes_moved"], rec
            seen.update((p.pid, p) for p in srv.descendants())
            want = load.served() + 10
            assert wait_until(lambda w=want: load.served() > w or bool(load.errors), 120)
        results = load.finish()
        assert load.errors == [], load.errors
        assert len(results) >= len(PROMPTS), "too few streams completed"
        for i, out in results:
            assert out == refs[i], f"prompt {i} changed: {out} != {refs[i]}"
        stats = httpx.get(f"{srv.url}/stats", headers=AUTH, timeout=30).json()
        assert [r["engine_id"] for r in stats["ranks"]] == [0, 1], stats["ranks"]
        # Every expert came from a peer (the transfers), none from the disk fallback.
        assert "read from disk" not in srv.output, srv.output
    finally:
        if load is not None:
            load.stop.set()
        seen.update((p.pid, p) for p in srv.descendants())
        srv.children = list(seen.values())  # every process it ever had, the joiner included
        srv.stop()
    assert srv.leftover_processes() == []
