"""The measured choice of CPU paths (``tidal/kernels/select.py``), without real timing: a
fake clock that each fake path advances by its own cost. A slow path is never chosen; the
cached timings are reused and invalidated when the CPU, the shapes or the version change;
a forced mode wins; a model's modules get the choice and serve by it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch

from tests.waiting import wait_until
from tidal.kernels import select
from tidal.kernels.select import (
    Candidate,
    Choice,
    ChoiceCache,
    OpKey,
    OpSpec,
    allowed,
    choose_paths,
    decide,
    default_choice,
    measure,
)
from tidal.layers.linear import Linear
from tidal.layers.norm import RMSNorm
from tidal.moe.layer import FusedMoE
from tidal.moe.reference import fused_experts_reference
from tidal.moe.router import softmax_topk

NTA, T0 = Candidate("native", "nta"), Candidate("native", "t0")
ONEDNN, TORCH = Candidate("onednn"), Candidate("torch")
ALL = (NTA, T0, ONEDNN, TORCH)


def _timings(
    decode: dict[Candidate, float],
    batch: dict[Candidate, float],
    prefill: dict[Candidate, float] | None = None,  # None: the batch's
) -> dict[str, Any]:
    return {
        "decode": {c.name: t for c, t in decode.items()},
        "batch": {c.name: t for c, t in batch.items()},
        "prefill": {c.name: t for c, t in (batch if prefill is None else prefill).items()},
    }


# ---- decide (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize("slow", ALL)
def test_a_slow_path_is_never_chosen(slow):
    """Whichever path is the slow one on this machine (the C++ kernels with the wrong
    prefetch hint on an Intel Xeon, oneDNN's per-call cost, torch), it does not serve."""
    fast = {c: 1.0 + 0.1 * i for i, c in enumerate(ALL)}
    times = {c: (50.0 if c == slow else t) for c, t in fast.items()}
    choice = decide(ALL, _timings(times, times))
    assert slow not in (choice.decode, choice.batch)
    assert choice.decode == min((c for c in ALL if c != slow), key=times.get)
    assert choice.layout == choice.decode.path and choice.source == "measured"


def test_weights_keep_one_layout_and_each_class_its_best_variant():
    # decode: t0 best; batch: oneDNN 1% ahead of nta. One layout per op (one copy of each
    # weight): native loses least in sum, and within it each class takes its own hint.
    choice = decide(
        ALL,
        _timings(
            {NTA: 2.0, T0: 1.0, ONEDNN: 3.0, TORCH: 4.0},
            {NTA: 10.1, T0: 12.0, ONEDNN: 10.0, TORCH: 30.0},
        ),
    )
    assert (choice.decode, choice.batch, choice.layout) == (T0, NTA, "native")
    assert choice.for_rows(1) == T0 and choice.for_rows(select.DECODE_MAX_ROWS + 1) == NTA


def test_a_prefill_takes_its_own_variant():
    """The third class: at a prefill chunk another variant of the held layout can win (the
    AMX tiles against the dot kernel on bf16 experts); calls take it only above
    ``BATCH_MAX_ROWS`` rows, and a path that wins only there does not move the layout."""
    fast_small = {NTA: 2.0, T0: 1.0, ONEDNN: 1.5, TORCH: 4.0}
    prefill = {NTA: 5.0, T0: 9.0, ONEDNN: 4.9, TORCH: 8.0}
    choice = decide(ALL, _timings(fast_small, fast_small, prefill))
    assert (choice.decode, choice.batch, choice.prefill, choice.layout) == (T0, T0, NTA, "native")
    assert choice.for_rows(select.BATCH_MAX_ROWS) == T0
    assert choice.for_rows(select.BATCH_MAX_ROWS + 1) == NTA
    assert Choice.from_dict(choice.as_dict()) == choice
    # A layout that wins only prefills does not take the weights: every decode step would
    # pay for it. The prefill takes the held layout's fastest variant.
    prefill = {NTA: 30.0, T0: 40.0, ONEDNN: 5.0, TORCH: 80.0}
    choice = decide(ALL, _timings(fast_small, fast_small, prefill))
    assert (choice.layout, choice.decode, choice.prefill) == ("native", T0, NTA)
    # Without weights each class is free: the prefill takes oneDNN.
    free = decide(ALL, _timings(fast_small, fast_small, prefill), holds_weights=False)
    assert (free.decode, free.prefill) == (T0, ONEDNN)


def test_trial_rows_stay_inside_their_classes():
    rows = select.trial_rows(32, 256)
    assert rows == {"decode": 1, "batch": 32, "prefill": 256}
    assert list(rows) == list(select.CLASSES)
    small = select.trial_rows(2, 16)  # --max-num-seqs 2, --max-num-batched-tokens 16
    assert Choice.fixed(T0, None).for_rows(1) == T0
    for cls, n in small.items():
        picks = {c: Candidate("native", c) for c in select.CLASSES}
        assert Choice(**picks, layout=None).for_rows(n) == picks[cls]


def test_ops_without_weights_choose_per_class():
    native, torch_ = Candidate("native"), TORCH
    choice = decide(
        (native, torch_),
        _timings({native: 1.0, torch_: 2.0}, {native: 5.0, torch_: 3.0}),
        holds_weights=False,
    )
    assert (choice.decode, choice.batch, choice.layout) == (native, torch_, None)


def test_unmeasured_or_failed_candidates_are_not_chosen():
    times = _timings({NTA: 3.0, TORCH: 2.0}, {NTA: 3.0, TORCH: 2.0})  # t0, onednn missing
    choice = decide(ALL, times)
    assert choice.decode == choice.batch == TORCH
    times["batch"][ONEDNN.name] = float("nan")
    assert decide(ALL, times).batch == TORCH


@pytest.mark.parametrize("mode", ["native", "onednn", "torch"])
def test_a_forced_mode_wins_over_the_timings(mode):
    times = {NTA: 9.0, T0: 8.0, ONEDNN: 7.0, TORCH: 6.0} if mode != "torch" else {}
    times = times or {NTA: 1.0, T0: 1.0, ONEDNN: 1.0, TORCH: 9.0}
    choice = decide(ALL, _timings(times, times), mode)
    assert choice.decode.path == choice.batch.path == choice.layout == mode
    assert choice.source in ("forced", "only")
    if mode == "native":  # among its own variants the faster hint
        assert choice.decode == T0


def test_forced_path_an_op_lacks_falls_back_to_torch():
    norm = (Candidate("native"), TORCH)
    assert allowed(norm, "onednn") == [TORCH]
    assert allowed((TORCH,), "native") == [TORCH]
    with pytest.raises(ValueError, match="cpu_kernels"):
        allowed(norm, "fast")


# ---- measure (a fake clock) --------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.calls: dict[str, int] = {}

    def __call__(self) -> float:
        return self.now

    def path(self, name: str, cost_s: float) -> Callable[[], None]:
        def run() -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.now += cost_s

        return run


def test_measure_times_each_call_and_ignores_the_slow_ones_noise_makes():
    clock = FakeClock()
    # Calls of "b" that land on a preemption, or wait for a descheduled second thread:
    # most of them (as on 2 shared cores), yet the fast end is the path's own speed.
    spikes = iter([0.5 if i % 4 else 0.0 for i in range(2000)])

    def noisy() -> None:
        clock.now += 0.001 + next(spikes)

    got = measure({"a": clock.path("a", 0.002), "b": noisy}, clock=clock)
    assert got == {"a": pytest.approx(2.0), "b": pytest.approx(1.0)}


def test_measure_stops_timing_far_slower_paths_and_skips_a_failing_one():
    clock = FakeClock()

    def broken() -> None:
        raise RuntimeError("no such kernel here")

    got = measure(
        {
            "fast": clock.path("fast", 1e-4),
            "slow": clock.path("slow", 5e-4),
            "hopeless": clock.path("hopeless", 1e-2),
            "bad": broken,
        },
        clock=clock,
        rounds=6,
        budget_s=0.012,
    )
    assert set(got) == {"fast", "slow", "hopeless"}
    assert got["hopeless"] > got["slow"] > 3 * got["fast"]
    warm = select.WARM_UP
    assert clock.calls["hopeless"] == warm  # its warm-up was 100x the fastest: not timed on
    per_round = int(0.012 / 6 / 5e-4)  # its share of the budget a round, in calls
    assert clock.calls["slow"] == warm + 2 * per_round  # warm-up + the first two rounds
    assert clock.calls["fast"] > 10


# ---- the cache -----------------------------------------------------------------------------


def _print(**changes: Any) -> dict[str, Any]:
    base = {"cpu_model": "Some CPU", "cpu_flags": "abc", "threads": 2, "tidal": "1", "format": 1}
    return {**base, **changes}


def test_cache_round_trip_and_invalidation(tmp_path):
    key = OpKey("linear", (256, 512, 0))
    times = _timings({NTA: 1.0, TORCH: 2.0}, {NTA: 3.0, TORCH: 4.0})
    cache = ChoiceCache(str(tmp_path), _print())
    assert cache.get(key, (NTA, TORCH)) is None
    cache.put(key, times)
    cache.save()
    again = ChoiceCache(str(tmp_path), _print())
    assert again.get(key, (NTA, TORCH)) == times
    assert again.get(OpKey("linear", (256, 1024, 0)), (NTA, TORCH)) is None  # other shape
    assert again.get(key, (NTA, T0, TORCH)) is None  # a candidate it never timed
    for changed in (_print(cpu_model="Intel Xeon"), _print(tidal="2"), _print(threads=1)):
        assert ChoiceCache(str(tmp_path), changed).get(key, (NTA, TORCH)) is None
    assert ChoiceCache(None, _print()).path is None  # no directory: nothing on disk
    with open(again.path, "w") as f:
        f.write("{not json")
    assert ChoiceCache(str(tmp_path), _print()).get(key, (NTA, TORCH)) is None


# ---- choose_paths over modules ---------------------------------------------------------------


class FakeModule:
    """A module with one op whose candidates cost what ``costs`` says (fake seconds)."""

    def __init__(
        self, clock: FakeClock, key: OpKey, costs: dict[Candidate, float], nbytes: int = 1 << 20
    ) -> None:
        self.clock, self.key, self.costs, self.nbytes = clock, key, costs, nbytes
        self.trials: list[tuple[str, int, int]] = []
        self.choice: Choice | None = None

    def cpu_ops(self) -> dict[str, OpSpec]:
        return {"op": OpSpec(self.key, tuple(self.costs), self.nbytes > 0, self.nbytes)}

    def cpu_trial(self, op: str, candidate: Candidate, instances: int) -> Any:
        def for_rows(rows: int) -> Any:
            self.trials.append((candidate.name, rows, instances))
            return self.clock.path(candidate.name, self.costs[candidate] * rows)

        return for_rows

    def set_cpu_path(self, op: str, choice: Choice) -> None:
        self.choice = choice


@pytest.fixture
def fake_cpu(monkeypatch):
    """The fingerprint's CPU, settable (a machine change), and a fake clock."""
    cpu = {"model": "AMD EPYC", "flags": "avx512f"}
    monkeypatch.setattr(select, "cpu_description", lambda: dict(cpu))
    monkeypatch.setattr(select, "oversubscribed", lambda *a, **k: None)  # a quiet machine
    return cpu, FakeClock()


def test_a_trial_streams_what_the_whole_model_streams(tmp_path, fake_cpu):
    """A trial rotates through as many bytes of stand-ins as the model's whole footprint
    (up to TRIAL_BYTES, in at most TRIAL_MAX_INSTANCES or one a layer): two 1 MiB layers
    beside a big model's other weights are read from memory there, not from cache."""
    _, clock = fake_cpu
    costs = {NTA: 3e-5, T0: 1e-5, TORCH: 2e-5}
    mib = 1 << 20

    def instances(mods: list[FakeModule]) -> int:
        return max(n for _, _, n in mods[0].trials)

    small = [FakeModule(clock, OpKey("linear", (64, 64, 0)), costs) for _ in range(2)]
    choose_paths(small, cache_dir=str(tmp_path / "a"), batch_rows=8, clock=clock)
    assert instances(small) == 2  # the whole model is 2 MiB: the trial reads 2 MiB too

    small = [FakeModule(clock, OpKey("linear", (64, 64, 0)), costs) for _ in range(2)]
    big = [FakeModule(clock, OpKey("linear", (64, 256, 0)), costs, 16 * mib) for _ in range(8)]
    choose_paths(small + big, cache_dir=str(tmp_path / "b"), batch_rows=8, clock=clock)
    assert instances(small) == select.TRIAL_MAX_INSTANCES  # 130 MiB beside it: from memory
    assert instances(big) == select.TRIAL_BYTES // (16 * mib)  # 6 of its 8 layers

    weightless = [FakeModule(clock, OpKey("norm", (64,)), costs, 0) for _ in range(3)]
    choose_paths(weightless + big, cache_dir=str(tmp_path / "c"), batch_rows=8, clock=clock)
    assert instances(weightless) == 3  # one a layer


def test_choose_paths_measures_once_then_reuses_until_the_machine_changes(tmp_path, fake_cpu):
    cpu, clock = fake_cpu
    costs = {NTA: 3e-5, T0: 1e-5, TORCH: 2e-5}  # t0 is this machine's fast hint
    key = OpKey("linear", (64, 64, 0))
    mods = [FakeModule(clock, key, costs) for _ in range(3)]
    report = choose_paths(mods, cache_dir=str(tmp_path), batch_rows=8, clock=clock)
    assert all(m.choice.decode == T0 and m.choice.source == "measured" for m in mods)
    assert {r for _, r, _ in mods[0].trials} == {1, 8, 256} and not mods[1].trials  # one trial
    assert max(n for _, _, n in mods[0].trials) == 3  # stand-ins for every layer: memory
    assert json.loads(json.dumps(report.as_dict()))["ops"][key.name]["decode"] == "native:t0"

    again = [FakeModule(clock, key, costs)]
    choose_paths(again, cache_dir=str(tmp_path), batch_rows=8, clock=clock)
    assert not again[0].trials and again[0].choice.source == "cached"
    assert again[0].choice.decode == T0

    forced = [FakeModule(clock, key, costs)]
    choose_paths(forced, mode="torch", cache_dir=str(tmp_path), clock=clock)
    assert forced[0].choice.decode == TORCH and not forced[0].trials

    other_shape = [FakeModule(clock, OpKey("linear", (64, 128, 0)), costs)]
    choose_paths(other_shape, cache_dir=str(tmp_path), batch_rows=8, clock=clock)
    assert other_shape[0].trials  # shapes are part of the key

    cpu["model"] = "Intel Xeon"  # another machine: there nta is the fast hint
    intel = [FakeModule(clock, key, {NTA: 1e-5, T0: 3e-5, TORCH: 2e-5})]
    choose_paths(intel, cache_dir=str(tmp_path), batch_rows=8, clock=clock)
    assert intel[0].trials and intel[0].choice.decode == NTA


def test_choose_paths_version_change_measures_again(tmp_path, fake_cpu, monkeypatch):
    _, clock = fake_cpu
    key = OpKey("norm", (64,))
    costs = {Candidate("native"): 1e-5, TORCH: 2e-5}
    choose_paths([FakeModule(clock, key, costs)], cache_dir=str(tmp_path), clock=clock)
    monkeypatch.setattr(select, "_tidal_version", lambda: "99.0")
    upgraded = FakeModule(clock, key, costs)
    choose_paths([upgraded], cache_dir=str(tmp_path), clock=clock)
    assert upgraded.trials and upgraded.choice.source == "measured"


# ---- the real layers: every path serves the same values ------------------------------------


def test_real_modules_choose_and_serve_by_the_choice(tmp_path, monkeypatch):
    """Linear, RMSNorm, decode attention and the MoE layer offer their paths, run trials on
    stand-ins, and take the choice; outputs equal the reference's on every forced path."""
    torch.manual_seed(0)
    lin, norm, moe = Linear(32, 48), RMSNorm(32, 1e-6), FusedMoE(8, 2, 32, 16, True)
    for p in (lin.weight, norm.weight, moe.gate, moe.w13, moe.w2):
        p.data.copy_(torch.randn(p.shape) * 0.3)
    weights = {k: v.clone() for k, v in (("w", lin.weight), ("w13", moe.w13), ("w2", moe.w2))}
    gate = moe.gate.detach().clone()
    monkeypatch.setattr(select, "oversubscribed", lambda *a, **k: None)  # the forced modes reuse it
    x = torch.randn(5, 32)
    want_lin = x @ weights["w"].T
    report = choose_paths([lin, norm, moe], cache_dir=str(tmp_path), batch_rows=8)
    assert {"linear[32x48x0]", "norm[32]", "moe[8x32x16x2x8]", "router[8x32x2]"} <= set(
        report.choices
    )
    for mode in ("auto", "native", "onednn", "torch"):
        choose_paths([lin, norm, moe], mode=mode, cache_dir=str(tmp_path), batch_rows=8)
        for m in (lin, moe):
            m.pack_weights()
        torch.testing.assert_close(lin(x), want_lin, atol=1e-5, rtol=0)
        assert torch.equal(lin.read_weights()["weight"], weights["w"])  # whichever layout
        held = moe.read_weights(["w13", "gate"])
        assert torch.equal(held["w13"], weights["w13"]) and torch.equal(held["gate"], gate)
        tw, ti = softmax_topk(x @ gate.T, 2, True)
        want = fused_experts_reference(x, weights["w13"], weights["w2"], tw, ti)
        torch.testing.assert_close(moe(x), want, atol=1e-5, rtol=0)


def test_a_trial_on_an_oversubscribed_machine_serves_but_is_not_kept(
    tmp_path, fake_cpu, monkeypatch
):
    _, clock = fake_cpu
    costs = {T0: 1e-3, TORCH: 2e-3}
    key = OpKey("linear", (8, 8, 0))
    monkeypatch.setattr(select, "oversubscribed", lambda *a, **k: "load average 6.0 on 2 cores")
    busy = FakeModule(clock, key, costs)
    choose_paths([busy], cache_dir=str(tmp_path), clock=clock)
    assert busy.trials and busy.choice.decode == T0  # this start is served by it
    monkeypatch.setattr(select, "oversubscribed", lambda *a, **k: None)
    quiet = FakeModule(clock, key, costs)
    choose_paths([quiet], cache_dir=str(tmp_path), clock=clock)
    assert quiet.trials and quiet.choice.source == "measured"  # measured again, then kept
    kept = FakeModule(clock, key, costs)
    choose_paths([kept], cache_dir=str(tmp_path), clock=clock)
    assert not kept.trials and kept.choice.source == "cached"


def test_trials_past_the_deadline_take_the_default_uncached(tmp_path, fake_cpu):
    _, clock = fake_cpu
    costs = {T0: 2e-3, TORCH: 1e-3}
    first, second = (FakeModule(clock, OpKey("linear", (8, n, 0)), costs) for n in (8, 16))
    choose_paths([first, second], cache_dir=str(tmp_path), clock=clock, deadline_s=1e-3)
    assert first.choice.decode == TORCH and first.choice.source == "measured"
    assert not second.trials and second.choice.source == "default"
    assert second.choice.decode == T0  # the C++ kernels, as before any measurement
    again = FakeModule(clock, second.key, costs)
    choose_paths([again], cache_dir=str(tmp_path), clock=clock)
    assert again.trials and again.choice.decode == TORCH  # measured at the next start


def test_the_default_is_the_amx_experts_then_the_t0_hint():
    dot_nta, dot_t0 = Candidate("native", "dot-nta"), Candidate("native", "dot-t0")
    amx, torch_ = Candidate("native", "amx"), Candidate("torch")
    assert default_choice([NTA, T0, dot_nta, dot_t0, amx, torch_], True).decode == amx
    assert default_choice([NTA, T0, dot_nta, dot_t0, torch_], True).decode == dot_t0
    choice = default_choice([NTA, T0, torch_], True)
    assert choice.decode == choice.batch == T0 and choice.layout == "native"
    assert default_choice([Candidate("onednn"), torch_], False).decode.path == "onednn"


def test_shared_choice_the_leader_measures_and_the_others_serve_by_its_choice(
    tmp_path, fake_cpu
):
    """A rank's TP workers: only the leader runs trials, every one serves by its choice
    (the exchange stands in for the TP group's all-gather), and a follower whose ops the
    leader did not choose for fails rather than serve apart from it."""
    from tidal.kernels.select import SharedChoice

    _, clock = fake_cpu
    key = OpKey("linear", (64, 32, 0))
    sent: list[dict] = []

    def lead(doc):
        sent.append(doc)
        return doc

    leader = FakeModule(clock, key, {NTA: 3e-5, T0: 1e-5, TORCH: 2e-5})
    report = choose_paths(
        [leader], cache_dir=str(tmp_path), clock=clock, share=SharedChoice(True, lead, "rank 0")
    )
    assert leader.trials and report.chosen_by is None and leader.choice.decode == T0
    # The follower's own trials would pick torch: it must not run them, nor differ.
    follower = FakeModule(clock, key, {NTA: 3e-5, T0: 9e-5, TORCH: 1e-6})
    got = choose_paths(
        [follower], cache_dir=str(tmp_path / "f"), clock=clock,
        share=SharedChoice(False, lambda doc: sent[0], "rank 0"),
    )  # fmt: skip
    assert not follower.trials and follower.choice == leader.choice
    assert got.chosen_by == "rank 0" and got.cache_file is None
    assert got.as_dict()["ops"] == report.as_dict()["ops"]
    other = FakeModule(clock, OpKey("linear", (64, 64, 0)), {T0: 1e-5, TORCH: 2e-5})
    with pytest.raises(RuntimeError, match="rank 0 chose no path"):
        choose_paths(
            [other], clock=clock, share=SharedChoice(False, lambda doc: sent[0], "rank 0")
        )
    torch_only = FakeModule(clock, key, {TORCH: 1e-5})  # the leader's native is not here
    with pytest.raises(RuntimeError, match="cannot run"):
        choose_paths(
            [torch_only], clock=clock, share=SharedChoice(False, lambda doc: sent[0], "rank 0")
        )


def test_the_kernels_build_is_part_of_the_fingerprint():
    """A rebuilt extension (a kernel changed) is another fingerprint: its file's hash."""
    from tidal.kernels.cpu_ext import kernel_available, kernel_status

    if not kernel_available():
        pytest.skip(kernel_status())
    build = select._kernel_build()
    assert len(build) == 16 and int(build, 16) >= 0, build
    assert select.fingerprint(1, torch.float32)["kernels"] == build


# ---- contention during the trials ------------------------------------------------------------


def _window(monkeypatch, *, cores: int, others_busy_s: float, own_s: float, wall_s: float):
    """A trial window of ``wall_s`` in which this process used ``own_s`` CPU seconds and
    the rest of the machine ``others_busy_s``."""
    monkeypatch.setattr(select.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    start = select.CpuSample(machine_busy_s=100.0, own_s=10.0, at_s=50.0, cores=cores)
    end = select.CpuSample(100.0 + own_s + others_busy_s, 10.0 + own_s, 50.0 + wall_s, cores)
    monkeypatch.setattr(select, "cpu_sample", lambda: end)
    return start


def test_others_using_the_cores_the_trial_runs_on_make_it_contended(monkeypatch):
    # One busy process beside a 2-thread trial on 2 cores: the trial's measurements are off.
    since = _window(monkeypatch, cores=2, others_busy_s=1.0, own_s=1.0, wall_s=1.0)
    assert "other processes used 1.0 of 2 cores" in select.oversubscribed(since, threads=2)
    # A quiet machine (a little background noise).
    since = _window(monkeypatch, cores=2, others_busy_s=0.1, own_s=2.0, wall_s=1.0)
    assert select.oversubscribed(since, threads=2) is None


def test_ranks_on_their_own_share_of_the_cores_are_not_contention(monkeypatch):
    # Two DP ranks, one thread each, measuring at the same time on 2 cores.
    since = _window(monkeypatch, cores=2, others_busy_s=1.0, own_s=1.0, wall_s=1.0)
    assert select.oversubscribed(since, threads=1) is None
    # ... but a third busy process on top is.
    since = _window(monkeypatch, cores=2, others_busy_s=1.8, own_s=0.6, wall_s=1.0)
    assert select.oversubscribed(since, threads=1) is not None


def test_a_process_that_moved_to_other_cores_during_the_trials_is_not_judged_by_them(
    monkeypatch,
):
    since = _window(monkeypatch, cores=2, others_busy_s=0.0, own_s=1.0, wall_s=1.0)
    since = select.CpuSample(since.machine_busy_s, since.own_s, since.at_s, cores=1)
    assert "cores changed" in select.oversubscribed(since, threads=1)


def test_only_the_cores_this_process_may_use_are_counted(monkeypatch):
    clk = os.sysconf("SC_CLK_TCK")
    stat = (
        "cpu  700 0 0 9000 0 0 0 0 0 0\n"
        f"cpu0 {clk} 0 {clk} 5000 7 0 0 {clk} 0 0\n"  # user, system, steal: 3 s busy
        f"cpu1 {10 * clk} 0 0 4000 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    monkeypatch.setattr(select, "open", lambda *a, **k: io.StringIO(stat), raising=False)
    assert select._busy_s({0}) == pytest.approx(3.0)
    assert select._busy_s({1}) == pytest.approx(10.0)
    assert select._busy_s({0, 1}) == pytest.approx(13.0)
    assert select._busy_s({0, 2}) is None  # a core /proc/stat does not list: unknown


def test_a_busy_process_pinned_to_another_core_is_not_on_ours():
    # Two DP ranks pinned a core each: one's loading is not contention for the other's trial.
    cores = sorted(os.sched_getaffinity(0))
    if select.cpu_sample().machine_busy_s is None or len(cores) < 2:
        pytest.skip("needs /proc/stat and two usable cores")
    ours, theirs = {cores[0]}, {cores[1]}
    code = (
        f"import os, time\nos.sched_setaffinity(0, {theirs!r})\n"
        "t = time.monotonic()\nwhile time.monotonic() - t < 30: pass\n"
    )
    busy = subprocess.Popen([sys.executable, "-c", code])
    try:
        ours0, theirs0 = select._busy_s(ours), select._busy_s(theirs)
        assert wait_until(lambda: psutil.Process(busy.pid).cpu_times().user >= 1.0, 60)
        ours1, theirs1 = select._busy_s(ours), select._busy_s(theirs)
    finally:
        busy.kill()
        busy.wait()
    assert theirs1 - theirs0 >= 0.9  # its core counted its spin
    # ...and ours did not (this test's own polling and the machine's noise stay under it).
    assert ours1 - ours0 < theirs1 - theirs0 - 0.5


def test_a_real_busy_process_is_seen_during_a_trial_window():
    if select.cpu_sample().machine_busy_s is None:
        pytest.skip("no /proc/stat here")
    code = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass\n"
    busy = subprocess.Popen([sys.executable, "-c", code])
    try:
        since = select.cpu_sample()
        # The window: this process idles until the other one has spun a CPU second.
        assert wait_until(lambda: psutil.Process(busy.pid).cpu_times().user >= 1.0, 60)
        why = select.oversubscribed(since, threads=len(os.sched_getaffinity(0)))
    finally:
        busy.kill()
        busy.wait()
    assert why is not None and "other processes used" in why
