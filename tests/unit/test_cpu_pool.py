"""The C++ kernels' spin pool (``tidal/kernels/csrc/pool.h``) against torch's OpenMP pool:
the same bits from every kernel that splits work over threads, workers that fall asleep
after their window, a forked child that starts a pool of its own, and the switch the
engine's spawn sets (``TIDAL_CPU_SPIN_US``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.cpu_kernels import keep_torch_threads, needs_kernel  # noqa: F401 - autouse fixture
from tests.waiting import wait_until
from tidal.kernels.cpu_attention import decode_attention_cpu
from tidal.kernels.cpu_ext import set_spin_pool, spin_pool_state
from tidal.kernels.cpu_linear import linear_cpu, pack_linear_weight
from tidal.kernels.cpu_moe import CpuPackedExperts, fused_experts_cpu
from tidal.kernels.cpu_norm import add_rms_norm_cpu, norm_rope_cpu, rms_norm_cpu
from tidal.kernels.cpu_router import CpuPackedGate, softmax_topk_cpu
from tidal.moe.router import softmax_topk
from tidal.utils.cpu_threads import SPIN_POOL_ENV, pool_spin_us

pytestmark = needs_kernel


@pytest.fixture
def openmp_after() -> Iterator[None]:
    """The process's kernels back on OpenMP after the test, whatever it set."""
    yield
    set_spin_pool(0)


def _kernels() -> list[Callable[[], torch.Tensor]]:
    """Calls of every kernel that splits its work over threads: the fused MoE (static
    runs), linear (static column blocks), decode attention and the router (dynamic tasks),
    the norms (row ranges; rows enough to split)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 128, generator=g)
    w13 = torch.randn(16, 192, 128, generator=g) / 128**0.5
    w2 = torch.randn(16, 128, 96, generator=g) / 96**0.5
    weights, ids = softmax_topk(torch.randn(37, 16, generator=g), 4, True)
    experts = CpuPackedExperts(w13, w2)
    lin = pack_linear_weight(torch.randn(520, 128, generator=g))
    cache = torch.randn(2, 32, 2, 4, 64, generator=g)
    tables = torch.randperm(32, generator=g)[:30].reshape(6, 5)
    lengths = torch.tensor([1, 4, 5, 17, 20, 9])
    q = torch.randn(6, 8, 64, generator=g)
    gate = CpuPackedGate(torch.randn(64, 1024, generator=g))
    hidden = torch.randn(300, 1024, generator=g)
    norm_w = torch.randn(1024, generator=g)
    heads = torch.randn(600, 8, 64, generator=g)
    cos, sin = torch.randn(2, 600, 1, 64, generator=g)
    return [
        lambda: rms_norm_cpu(hidden, norm_w, 1e-6),
        lambda: torch.cat(add_rms_norm_cpu(hidden, hidden.flip(0), norm_w, 1e-6)),
        lambda: norm_rope_cpu(heads, cos, sin, (norm_w[:64], norm_w[64:128]), 4, 1e-6),
        lambda: fused_experts_cpu(x, experts, weights, ids),
        lambda: linear_cpu(x, lin, 520),
        lambda: decode_attention_cpu(q, cache, tables, lengths, 0.125),
        lambda: torch.cat([t.float() for t in softmax_topk_cpu(hidden, gate, 8, True)], 1),
    ]


@pytest.mark.parametrize("threads", [2, 3])  # 3 on a 2-core machine: a part gets preempted
def test_the_pool_gives_openmps_bits(threads, openmp_after):
    torch.set_num_threads(threads)
    calls = _kernels()
    set_spin_pool(0)
    want = [f() for f in calls]
    set_spin_pool(200)
    for _ in range(3):  # the first call starts the workers, later ones find them awake
        for f, w in zip(calls, want, strict=True):
            assert torch.equal(f(), w)
    spin_us, workers = spin_pool_state()
    assert spin_us == 200 and workers >= threads - 1


def test_two_callers_at_once_get_their_own_bits(openmp_after):
    """Kernels called from two threads at once: one holds the pool, the other runs its parts
    inline; both get OpenMP's bits."""
    torch.set_num_threads(2)
    calls = _kernels()
    set_spin_pool(0)
    want = [f() for f in calls]
    set_spin_pool(200)
    failures: list[str] = []

    def caller(name: str) -> None:
        for _ in range(10):
            for i, (f, w) in enumerate(zip(calls, want, strict=True)):
                if not torch.equal(f(), w):
                    failures.append(f"{name}: kernel {i}")

    threads = [threading.Thread(target=caller, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert failures == []


def _worker_states() -> dict[str, str]:
    """Name (tidal-cpu-N: worker N) -> state letter of this process's pool workers."""
    out: dict[str, str] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            if name.startswith("tidal-cpu-"):
                stat = (task / "stat").read_text()
                out[name] = stat[stat.rindex(")") + 2]
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return out


def test_workers_sleep_after_their_window(openmp_after):
    torch.set_num_threads(2)
    set_spin_pool(1000)  # 1 ms
    call = _kernels()[0]
    call()
    assert _worker_states(), "the pool started no worker"
    asleep = wait_until(lambda: all(s == "S" for s in _worker_states().values()), 30)
    assert asleep, f"workers still spinning: {_worker_states()}"  # spinning: R
    want = call()  # and a sleeping pool wakes for the next kernel
    set_spin_pool(0)
    assert torch.equal(call(), want)


def test_workers_past_the_thread_count_stay_asleep(openmp_after):
    """After torch.set_num_threads lowers the count, a worker past it takes no part in the
    jobs, and they neither wake it nor restart its window: it sleeps while the others
    serve (here with a 1 s window, which every job would restart)."""
    set_spin_pool(1_000_000)
    call = _kernels()[0]
    torch.set_num_threads(3)
    call()  # workers 1 and 2
    torch.set_num_threads(2)  # worker 2 is past the count

    def serving_while_worker_2_sleeps() -> bool:
        call()  # a job each poll (well inside the window): worker 1's part
        return _worker_states()["tidal-cpu-2"] == "S"

    assert wait_until(serving_while_worker_2_sleeps, 30), (
        f"the idle worker kept spinning: {_worker_states()}"
    )


def test_a_forked_child_runs_a_pool_of_its_own(openmp_after):
    torch.set_num_threads(2)
    call = _kernels()[0]
    set_spin_pool(200)
    want = call()  # the parent's workers exist and spin
    want_bytes = want.numpy().tobytes()
    pid = os.fork()
    if pid == 0:  # the child: no worker threads came with it
        ok = False
        try:  # (numpy compares: a torch op on OpenMP may hang in a child, libgomp's rule)
            ok = call().numpy().tobytes() == want_bytes and spin_pool_state()[0] == 200
        finally:
            os._exit(0 if ok else 1)
    statuses: list[int] = []

    def reaped() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            statuses.append(status)
        return bool(done)

    if not wait_until(reaped, 60):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the pool")
    assert os.waitstatus_to_exitcode(statuses[0]) == 0


def test_the_window_comes_from_the_spawn_environment():
    assert pool_spin_us({}) == 0 and pool_spin_us({SPIN_POOL_ENV: " 150 "}) == 150
    assert pool_spin_us({SPIN_POOL_ENV: "0"}) == 0
    for bad in ("-1", "abc", "2000000", "1.5"):
        with pytest.raises(ValueError, match=SPIN_POOL_ENV):
            pool_spin_us({SPIN_POOL_ENV: bad})
    with pytest.raises(RuntimeError, match="spin_us"):
        set_spin_pool(-5)
