"""The C++ fused MoE kernel (``tidal/kernels/csrc/moe_cpu.cpp``) against the oracle
``tidal/moe/reference.py``: shapes that do not fill its blocks, expert maps, ids that are
not local, 1 and 2 threads; its packed layout; and its input checks."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.background import Job, job_of, started_with_the_session
from tests.cpu_kernels import keep_torch_threads, needs_kernel  # noqa: F401 - autouse fixture
from tidal.kernels.cpu_ext import kernel_status
from tidal.kernels.cpu_moe import (
    DOWN_BLOCK,
    GATE_BLOCK,
    CpuPackedExperts,
    down_run,
    fused_experts_cpu,
)
from tidal.moe.layer import build_expert_map
from tidal.moe.reference import fused_experts_reference
from tidal.moe.router import softmax_topk


def test_pip_install_built_the_kernel():
    """Where a C++ compiler exists, ``pip install -e .`` builds the kernel and it loads:
    a silent build failure would otherwise only show as a slower CPU path."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the torch path serves")
    assert kernel_status() == "ok"


def _compile_for_x86_64_v2() -> Job | None:
    """g++ on each source that holds ISA-targeted kernels, for plain x86-64-v2 (None: no
    g++ here)."""
    import pathlib
    import sysconfig

    from torch.utils import cpp_extension

    cxx = shutil.which("g++")
    if cxx is None:
        return None
    csrc = pathlib.Path(__file__).resolve().parents[2] / "tidal" / "kernels" / "csrc"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    flags = ["-std=c++17", "-O0", "-march=x86-64-v2", "-fopenmp", "-fPIC", "-c"]
    return Job(
        {
            source: [cxx, *flags, str(csrc / f"{source}.cpp"), *(f"-I{p}" for p in includes)]
            + ["-o", "/dev/null"]
            for source in ("fp8_cpu", "linear_cpu", "moe_cpu", "router_cpu")
        }
    )


@pytest.mark.slow
@started_with_the_session(_compile_for_x86_64_v2)
def test_the_kernels_compile_for_a_cpu_without_avx512(request):
    """setup.py builds with -march=native, so the AVX-512, AVX512-BF16 and AMX kernels carry
    their own target attributes and are only called where the CPU has them. A body that
    loses its target (a lambda inside such a function does) would not compile on a build
    machine without AVX-512, and the optional extension would vanish there, silently:
    compile each source that holds such kernels for plain x86-64-v2 (-O0: always_inline is
    honoured, so a target mismatch is an error as at -O3). The compilers (each spends
    seconds parsing torch's headers) start niced with the session (tests/background.py)."""
    job = job_of(request)
    if job is None:
        pytest.skip("no g++ on this machine")
    try:
        failed = {src: out for src, (rc, out) in job.results(timeout_s=240).items() if rc != 0}
    finally:
        job.stop()
    assert failed == {}, failed


def _problem(tokens, hidden, inter, experts, top_k, local, seed):
    g = torch.Generator().manual_seed(seed)
    nloc = experts if local is None else len(local)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(nloc, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(nloc, hidden, inter, generator=g) / inter**0.5
    weights, ids = softmax_topk(torch.randn(tokens, experts, generator=g), top_k, True)
    emap = None if local is None else build_expert_map(experts, local)
    return x, w13, w2, weights, ids, emap


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])  # 3: static runs of unequal length
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k,local",
    [(1, 64, 32, 8, 2, None), (7, 100, 20, 8, 3, None), (33, 128, 96, 16, 4, None),
     (257, 64, 64, 8, 2, None), (40, 72, 48, 8, 2, [6, 1, 3]), (19, 64, 32, 8, 2, [2]),
     (5, 48, 16, 4, 4, [3, 2, 1, 0]), (0, 64, 32, 8, 2, None)],
)  # fmt: skip
@pytest.mark.parametrize("apply_router_weight", [True, False])
def test_kernel_matches_reference(threads, tokens, hidden, inter, experts, top_k, local,
                                  apply_router_weight):  # fmt: skip
    torch.set_num_threads(threads)
    x, w13, w2, weights, ids, emap = _problem(tokens, hidden, inter, experts, top_k, local, 7)
    want = fused_experts_reference(x, w13, w2, weights, ids, emap, apply_router_weight)
    got = fused_experts_cpu(x, CpuPackedExperts(w13, w2), weights, ids, emap, apply_router_weight)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_kernel_ids_not_local_duplicates_and_strided_hidden():
    x, w13, w2, weights, _, _ = _problem(6, 64, 32, 4, 2, None, 3)
    ids = torch.tensor(
        [[0, 9], [-1, 1], [7, -5], [3, 3], [2, 2], [1, 0]]
    )  # 9, 7, -5, -1: elsewhere
    packed = CpuPackedExperts(w13, w2)
    want = fused_experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts_cpu(x, packed, weights, ids), want, atol=2e-5, rtol=0)
    assert torch.count_nonzero(want[2]) == 0
    # Through a map (ids in range: the reference indexes the map with them).
    emap = build_expert_map(4, [3, 0, 2])
    want = fused_experts_reference(x, w13, w2, weights, ids.clamp(0, 3), emap)
    got = fused_experts_cpu(x, packed, weights, ids.clamp(0, 3), emap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    wide = torch.randn(6, 128)[:, ::2]  # not contiguous
    want = fused_experts_reference(wide, w13, w2, weights, ids)
    torch.testing.assert_close(
        fused_experts_cpu(wide, packed, weights, ids), want, atol=2e-5, rtol=0
    )


@pytest.mark.parametrize("run", [1, 2])
def test_packed_layout(run):
    """Block j of ``w13`` holds gate then up columns 32j.. for each input column; ``w2``
    holds the output column blocks in runs of R, expert by expert within a run: block j of
    expert e at ``w2[j // R, e, j % R]``, the down weights of output columns 64j..; zero
    past I and H."""
    _, w13, w2, _, _, _ = _problem(1, 70, 40, 3, 1, None, 5)
    p = CpuPackedExperts(w13, w2, run=run)
    assert p.w13.shape == (3, 2, 70, 2 * GATE_BLOCK)
    assert p.w2.shape == (2 // run, 3, run, 64, DOWN_BLOCK)

    def down(e: int, j: int) -> torch.Tensor:  # [I_pad, 64]
        return p.w2[j // run, e, j % run]

    e, k = 2, 11
    for col in (0, 31, 32, 39):
        j, c = divmod(col, GATE_BLOCK)
        assert p.w13[e, j, k, c] == w13[e, col, k]  # gate
        assert p.w13[e, j, k, GATE_BLOCK + c] == w13[e, 40 + col, k]  # up
        assert down(e, 0)[col, 5] == w2[e, 5, col]
        assert down(e, 1)[col, 69 - DOWN_BLOCK] == w2[e, 69, col]
    assert torch.count_nonzero(p.w13[:, 1, :, 8:GATE_BLOCK]) == 0  # gate columns 40..63
    assert torch.count_nonzero(p.w2[:, :, :, 40:]) == 0  # intermediate rows past I
    for e in range(3):
        assert torch.count_nonzero(down(e, 1)[:, 70 - DOWN_BLOCK :]) == 0  # outputs past H
    assert all(torch.equal(a, b) for a, b in zip(p.unpack(), (w13, w2), strict=True))
    with pytest.raises(ValueError, match="run 3 does not divide"):
        CpuPackedExperts(w13, w2, run=3)


def test_down_run_is_one_threads_share_that_divides_the_blocks():
    assert [down_run(8, t) for t in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]
    assert down_run(7, 2) == 1 and down_run(6, 4) == 2 and down_run(1, 2) == 1


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_run_and_thread_count_give_the_same_bits(dtype):
    """The down pass adds a token's experts in expert order whatever the pack's run and
    the threads: every (run, threads) pair gives R = 1's result on one thread, bit for bit
    (a decode and a batch, H = 6 column blocks, some experts idle)."""
    x, w13, w2, weights, ids, _ = _problem(24, 6 * DOWN_BLOCK, 48, 16, 4, None, 3)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = {t: fused_experts_cpu(x[:t], CpuPackedExperts(w13, w2, run=1), weights[:t], ids[:t])
                for t in (1, 24)}  # fmt: skip
        for run in (1, 2, 3, 6):
            packed = CpuPackedExperts(w13, w2, run=run)
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                for t, out in want.items():
                    got = fused_experts_cpu(x[:t], packed, weights[:t], ids[:t])
                    assert torch.equal(got, out), (run, threads, t)
                torch.set_num_threads(1)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_kernel_rejects_bad_inputs_with_errors():
    x, w13, w2, weights, ids, _ = _problem(4, 64, 32, 4, 2, None, 1)
    packed = CpuPackedExperts(w13, w2)
    with pytest.raises(ValueError, match="float32"):
        fused_experts_cpu(x.double(), packed, weights, ids)
    with pytest.raises(ValueError, match="width"):
        fused_experts_cpu(torch.randn(4, 32), packed, weights, ids)
    with pytest.raises(RuntimeError, match="topk"):
        fused_experts_cpu(x, packed, weights[:3], ids)
    with pytest.raises(RuntimeError, match="w13p"):
        torch.ops.tidal_cpu.fused_moe(
            x, packed.w13[:, :, :, :32], packed.w2, weights, ids, None, True
        )
    with pytest.raises(ValueError, match="float32"):
        CpuPackedExperts(w13.half(), w2.half())
    with pytest.raises(ValueError, match="does not match"):
        CpuPackedExperts(w13, w2[:, :, :16])


@pytest.mark.parametrize("instances", [1, 8])
def test_the_experts_trial_reads_a_new_routing_each_call(monkeypatch, instances):
    """The measured choice's experts trial routes each call anew, so a 1-row decode trial
    streams the experts as serving does instead of reading the same top-k from cache call
    after call; with 8 stand-ins (a multiple of ``TRIAL_ROUTINGS``) too, each stand-in
    meets every routing."""
    from tidal.kernels.select import Candidate
    from tidal.moe.layer import TRIAL_ROUTINGS, FusedMoE

    moe = FusedMoE(16, 2, 32, 24, True, list(range(16)))
    seen: list[tuple[int, tuple[int, ...]]] = []
    real = FusedMoE.forward_experts

    def record(self, x, weights, ids):
        seen.append((id(self), tuple(ids.flatten().tolist())))
        return real(self, x, weights, ids)

    monkeypatch.setattr(FusedMoE, "forward_experts", record)
    call = moe.cpu_trial("experts", Candidate("torch"), instances)(1)
    count = TRIAL_ROUTINGS if instances == 1 else TRIAL_ROUTINGS + 1  # coprime with 8
    for _ in range(2 * count * instances):
        call()
    routings = {r for _, r in seen}
    assert len(routings) == count  # distinct routings, each met again in the next turn
    assert all(len(set(r)) == 2 for r in routings)  # top-2 distinct experts a token
    by_stand_in: dict[int, set[tuple[int, ...]]] = {}
    for who, r in seen:
        by_stand_in.setdefault(who, set()).add(r)
    assert len(by_stand_in) == instances
    assert all(rs == routings for rs in by_stand_in.values())
