"""Sampler: each parameter's effect, the reference warpers of transformers, seeded
reproducibility, the sampled distribution and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tidal.layers.sampler import (
    RowInfo,
    Sampler,
    SamplingMetadata,
    _sample,
    compute_logprobs,
    position_seed,
    process_logits,
)
from tidal.sampling_params import SamplingParams

torch.set_num_threads(1)
SAMPLER = Sampler()
# Chi-square critical value for 7 degrees of freedom at p = 0.001.
CHI2_CRIT_DF7 = 24.32


def rows_of(params: list[SamplingParams], **kw) -> list[RowInfo]:
    return [RowInfo(params=p, **kw) for p in params]


def sample(logits: torch.Tensor, rows: list[RowInfo]) -> torch.Tensor:
    return SAMPLER(logits, SamplingMetadata.build(rows, "cpu")).token_ids


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws of one distribution: n identical rows in one batch."""
    torch.manual_seed(seed)
    return sample(logits_row.expand(n, -1).contiguous(), rows_of([params] * n))


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :]  # [1, V]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- greedy -------------------------------------------------------------------------


def test_greedy_fast_path_is_plain_argmax(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    meta = SamplingMetadata.build(rows_of([SamplingParams(temperature=0.0)] * 8), "cpu")
    assert meta.fast_greedy
    # Slow reference: the general path on the same metadata.
    slow = _sample(logits, meta)

    def forbidden(*a, **k):
        raise AssertionError("fast greedy path must not sort, clone or draw")

    for name in ("sort", "topk", "clone", "exponential_"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    fast = SAMPLER(logits, meta).token_ids
    monkeypatch.undo()
    assert torch.equal(fast, torch.argmax(logits, dim=-1))
    assert torch.equal(fast, slow)
    assert fast.dtype == torch.int64


def test_greedy_rows_in_mixed_batch_equal_argmax_of_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    params = [
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3),  # warpers ignored
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.1),
        SamplingParams(temperature=0.0, seed=9),
        SamplingParams(),
    ]
    rows = [RowInfo(p) for p in params]
    meta = SamplingMetadata.build(rows, "cpu")
    assert not meta.fast_greedy and not meta.all_greedy and not meta.all_random
    out = SAMPLER(logits, meta).token_ids
    ref = torch.argmax(logits, dim=-1)
    for i in (0, 2, 4):
        assert out[i] == ref[i]


def test_greedy_with_penalty_takes_general_path_and_applies_it():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    meta = SamplingMetadata.build([RowInfo(p, prompt_token_ids=[0])], "cpu")
    assert not meta.fast_greedy
    assert SAMPLER(logits, meta).token_ids.tolist() == [1]  # 3.0 / 2 < 2.9


def test_sampler_does_not_modify_logits():
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=4, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(top_p=0.5, min_p=0.2),
    ]
    rows = [
        RowInfo(p, prompt_token_ids=[1, 2], output_token_ids=[3], eos_token_id=0) for p in params
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


# --- top_k / top_p / min_p / temperature -----------------------------------------


def test_top_k_1_equals_greedy():
    torch.manual_seed(3)
    logits = torch.randn(64, 100)
    rows = rows_of([SamplingParams(temperature=1.5, top_k=1)] * 64)
    assert torch.equal(sample(logits, rows), logits.argmax(dim=-1))


def test_top_k_restricts_support():
    torch.manual_seed(4)
    logits = torch.randn(1, 20) * 0.3  # flat enough that all of the top 5 show up
    tokens = draws(logits, SamplingParams(top_k=5), 3000)
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) == top5


def test_top_p_keeps_smallest_nucleus():
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    for top_p, support in ((0.4, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})):
        meta = SamplingMetadata.build(rows_of([SamplingParams(top_p=top_p)]), "cpu")
        kept = torch.isfinite(process_logits(logits, meta))[0].nonzero().flatten().tolist()
        assert set(kept) == support, top_p
    tokens = draws(logits, SamplingParams(top_p=0.7), 4000)
    assert set(tokens.tolist()) == {0, 1}
    # Renormalised over the nucleus: 0.5 / 0.8.
    assert abs((tokens == 0).float().mean().item() - 0.625) < 0.03


def test_top_p_applies_after_top_k_renormalisation():
    # After top_k=2 the kept mass is 0.5 and 0.3 -> 0.625 / 0.375; top_p=0.6 keeps one.
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    meta = SamplingMetadata.build(rows_of([SamplingParams(top_k=2, top_p=0.6)]), "cpu")
    assert torch.isfinite(process_logits(logits, meta))[0].tolist() == [True, False, False, False]


def test_min_p():
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    for min_p, support in ((0.2, {0, 1, 2}), (0.7, {0}), (0.05, {0, 1, 2, 3})):
        meta = SamplingMetadata.build(rows_of([SamplingParams(min_p=min_p)]), "cpu")
        kept = torch.isfinite(process_logits(logits, meta))[0].nonzero().flatten().tolist()
        assert set(kept) == support, min_p
    assert set(draws(logits, SamplingParams(min_p=0.7), 200).tolist()) == {0}


def test_min_p_applies_before_top_p():
    """vLLM's order: min_p (0.25 x 0.5 drops the two 0.1s) renormalises what top_p then
    sees (0.625, 0.375): top_p=0.6 keeps one token. The other order would keep two."""
    logits = probs_logits([0.5, 0.3, 0.1, 0.1])
    meta = SamplingMetadata.build(rows_of([SamplingParams(min_p=0.25, top_p=0.6)]), "cpu")
    assert torch.isfinite(process_logits(logits, meta))[0].tolist() == [True, False, False, False]


def test_temperature_sharpens_and_flattens():
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    n = 6000
    freq_top = {}
    for t in (0.5, 1.0, 2.0):
        tokens = draws(logits, SamplingParams(temperature=t), n, seed=5)
        emp = torch.bincount(tokens, minlength=4).float() / n
        expected = torch.softmax(logits[0] / t, dim=-1)
        assert (emp - expected).abs().max() < 0.03, t
        freq_top[t] = emp[0].item()
    assert freq_top[0.5] > freq_top[1.0] > freq_top[2.0]


def _reference_warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row through transformers' warpers, in the order the sampler documents."""
    scores = row[None, :].clone()
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    ids = torch.zeros(1, 1, dtype=torch.int64)
    for w in warpers:
        scores = w(ids, scores)
    return scores[0]


@pytest.mark.parametrize(
    "params",
    [
        # top_k only (partial top-k path), with a disabled row and k > V.
        [
            SamplingParams(top_k=3),
            SamplingParams(top_k=10),
            SamplingParams(),
            SamplingParams(top_k=999),
        ],
        # top_p only and top_k + top_p (sort path), plus min_p and temperatures.
        [
            SamplingParams(top_p=0.6),
            SamplingParams(top_k=8, top_p=0.5, temperature=0.7),
            SamplingParams(top_k=2),
            SamplingParams(temperature=1.8, top_p=0.95, min_p=0.05),
            SamplingParams(),
        ],
        [SamplingParams(min_p=0.1, temperature=0.5), SamplingParams(min_p=0.0)],
    ],
)
def test_warpers_match_transformers_reference(params):
    torch.manual_seed(6)
    logits = torch.randn(len(params), 64) * 2
    meta = SamplingMetadata.build(rows_of(params), "cpu")
    got = process_logits(logits, meta)
    for i, p in enumerate(params):
        ref = _reference_warp(logits[i], p)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(ref)), i
        fin = torch.isfinite(ref)
        torch.testing.assert_close(got[i][fin], ref[fin])


# --- penalties ----------------------------------------------------------------------


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(7)
    logits = torch.randn(2, 30) * 3
    prompt, output = [1, 5, 5, 9, 20], [9, 2, 17, 17]
    rows = [
        RowInfo(
            SamplingParams(repetition_penalty=1.7), prompt_token_ids=prompt, output_token_ids=output
        ),
        RowInfo(
            SamplingParams(repetition_penalty=0.6), prompt_token_ids=[3], output_token_ids=[3, 4]
        ),
    ]
    got = process_logits(logits, SamplingMetadata.build(rows, "cpu"))
    for i, r in enumerate(rows):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        ref = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(
            ids, logits[i : i + 1].clone()
        )
        assert torch.equal(got[i], ref[0])
    assert not torch.equal(got, logits)


def test_frequency_and_presence_penalties_exact():
    logits = torch.tensor([[1.0, 2.0, -0.5, 0.25, 0.0, 3.0, 1.5]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [RowInfo(p, prompt_token_ids=[0, 1, 6], output_token_ids=[3, 3, 5, 2, 3])]
    got = process_logits(logits, SamplingMetadata.build(rows, "cpu"))
    # token: count -> logit - 0.5 * count - 0.25 (prompt tokens are not counted)
    expected = torch.tensor([[1.0, 2.0, -0.5 - 0.75, 0.25 - 1.75, 0.0, 3.0 - 0.75, 1.5]])
    assert torch.equal(got, expected)


def test_negative_presence_penalty_encourages_repetition():
    logits = torch.tensor([[1.0, 1.2, 0.0]])
    p = SamplingParams(temperature=0.0, presence_penalty=-0.5)
    assert sample(logits, [RowInfo(p, output_token_ids=[0])]).tolist() == [0]


def test_penalties_leave_other_rows_untouched():
    torch.manual_seed(8)
    logits = torch.randn(3, 20)
    rows = [
        RowInfo(SamplingParams(), output_token_ids=[1, 2, 3], prompt_token_ids=[4]),
        RowInfo(
            SamplingParams(frequency_penalty=1.0, repetition_penalty=1.3), output_token_ids=[1, 1]
        ),
        RowInfo(SamplingParams(temperature=0.0), output_token_ids=[5]),
    ]
    got = process_logits(logits, SamplingMetadata.build(rows, "cpu"))
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 1] < logits[1, 1]


# --- min_tokens / ignore_eos --------------------------------------------------------


def _stop_logits() -> torch.Tensor:
    logits = torch.zeros(1, 10)
    logits[0, 7] = 10.0  # EOS
    logits[0, 4] = 9.0  # stop token id
    logits[0, 2] = 1.0
    return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids_until_reached(temperature):
    p = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[4, 99])
    logits = _stop_logits()
    for n_out in range(3):
        row = RowInfo(p, output_token_ids=[2] * n_out, eos_token_id=7)
        meta = SamplingMetadata.build([row], "cpu")
        x = process_logits(logits, meta)
        assert x[0, 7] == -math.inf and x[0, 4] == -math.inf
        tokens = sample(logits.expand(50, -1).contiguous(), [row] * 50)
        assert not ({4, 7} & set(tokens.tolist()))
    done = RowInfo(
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
        output_token_ids=[2] * 3,
        eos_token_id=7,
    )
    assert sample(logits, [done]).tolist() == [7]


def test_ignore_eos_unblocks_eos_but_not_stop_ids():
    p = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[4], ignore_eos=True)
    logits = _stop_logits()
    x = process_logits(logits, SamplingMetadata.build([RowInfo(p, eos_token_id=7)], "cpu"))
    assert x[0, 7] == 10.0 and x[0, 4] == -math.inf
    logits[0, 7] = -1.0
    assert sample(logits, [RowInfo(p, eos_token_id=7)]).tolist() == [2]


# --- randomness ---------------------------------------------------------------------


def _seeded_run(seed: int, companions: list[SamplingParams], steps: int = 12) -> list[int]:
    """Tokens of one seeded request over several steps, batched with ``companions``."""
    torch.manual_seed(1234 + len(companions))  # companions' (global) noise differs per run
    base = torch.randn(steps, 30, generator=gen(99))
    out = []
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    for step in range(steps):
        n = 1 + len(companions)
        logits = torch.randn(n, 30)
        pos = step % n  # the seeded row moves around the batch
        logits[pos] = base[step]
        rows = [RowInfo(c, output_token_ids=[1] * (step % 3)) for c in companions]
        rows.insert(pos, RowInfo(p, output_token_ids=list(out)))
        out.append(sample(logits, rows)[pos].item())
    return out


def test_seeded_rows_reproducible_across_runs_and_batches():
    alone = _seeded_run(11, [])
    assert alone == _seeded_run(11, [])
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, temperature=0.3, min_p=0.2),
        SamplingParams(repetition_penalty=1.2, temperature=2.0),
    ]
    assert alone == _seeded_run(11, mixed)
    assert alone == _seeded_run(11, mixed[1:])
    assert alone != _seeded_run(12, [])


def test_position_seed_is_splitmix64():
    # Pinned: changing the mix changes every seeded output ever produced.
    assert position_seed(0, 0) == 0xE220A8397B1DCDAF  # splitmix64's first output from 0
    assert position_seed(-1, 0) == position_seed(2**64 - 1, 0)  # int64 seeds wrap
    seeds = {position_seed(s, p) for s in (0, 1, -1, 2**63 - 1) for p in range(50)}
    assert len(seeds) == 200 and all(0 <= x < 2**64 for x in seeds)


def _seeded_token(logits: torch.Tensor, seed: int, outputs: list[int], **kw) -> int:
    p = SamplingParams(temperature=1.0, seed=seed, **kw)
    meta = SamplingMetadata.build([RowInfo(p, output_token_ids=outputs)], "cpu")
    return SAMPLER(logits, meta).token_ids.item()


def test_seeded_draw_depends_only_on_seed_and_output_position():
    logits = torch.zeros(1, 1000)  # uniform: the token is the noise's argmin
    # The same position with any history (prompt, output ids) draws the same noise ...
    a = _seeded_token(logits, 5, [1, 2, 3])
    assert a == _seeded_token(logits, 5, [9, 9, 9])
    meta = SamplingMetadata.build(
        [RowInfo(SamplingParams(seed=5), prompt_token_ids=[4] * 7, output_token_ids=[0] * 3)],
        "cpu",
    )
    assert SAMPLER(logits, meta).token_ids.item() == a
    # ... and other positions or seeds draw other noise.
    assert len({_seeded_token(logits, 5, [0] * k) for k in range(8)}) > 4
    assert len({_seeded_token(logits, s, [0] * 3) for s in range(8)}) > 4
    # Nothing is consumed: drawing again at the same position repeats the token.
    assert _seeded_token(logits, 5, [1, 2, 3]) == a


def test_seeded_draw_independent_of_cpu_thread_count():
    torch.manual_seed(13)
    logits = torch.randn(3, 50_000)  # wide enough for a parallel noise kernel
    rows = [RowInfo(SamplingParams(seed=s), output_token_ids=[0] * s) for s in (1, 2, 3)]
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 4):
            torch.set_num_threads(n)
            got.append(SAMPLER(logits, SamplingMetadata.build(rows, "cpu")).token_ids.tolist())
    finally:
        torch.set_num_threads(threads)
    assert got[0] == got[1]


def test_unseeded_rows_vary():
    logits = torch.zeros(1, 1000)
    torch.manual_seed(0)
    a = sample(logits, rows_of([SamplingParams()]))
    b = [sample(logits, rows_of([SamplingParams()])).item() for _ in range(5)]
    assert set(b) != {a.item()}


def test_empirical_distribution_matches_softmax_global_rng():
    torch.manual_seed(10)
    logits = torch.randn(1, 8)
    n = 8000
    tokens = draws(logits, SamplingParams(), n, seed=11)
    counts = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits[0].double(), dim=-1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_CRIT_DF7, chi2


def test_empirical_distribution_matches_softmax_seeded_row():
    logits = torch.tensor([[0.3, -1.0, 1.2, 0.0, 0.5, -0.2, 0.9, -2.0]])
    n = 3000
    # One seed, output positions 0..n-1: the per-position draws are independent.
    row = RowInfo(SamplingParams(seed=21))
    tokens = []
    for pos in range(n):
        row.output_token_ids = [0] * pos
        tokens.append(SAMPLER(logits, SamplingMetadata.build([row], "cpu")).token_ids.item())
    tokens = torch.tensor(tokens)
    counts = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits[0].double(), dim=-1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_CRIT_DF7, chi2


# --- logprobs -----------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_rank():
    torch.manual_seed(12)
    logits = torch.randn(4, 15)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, top_k=4, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),  # no logprobs asked
        SamplingParams(logprobs=0, top_p=0.5),
        SamplingParams(logprobs=20, temperature=0.0, frequency_penalty=1.0),  # k > V
    ]
    rows = [RowInfo(p, prompt_token_ids=[0, 1], output_token_ids=[2]) for p in params]
    out = SAMPLER(logits, SamplingMetadata.build(rows, "cpu"))
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, k in ((0, 3), (2, 0), (3, 15)):
        lp = out.logprobs[i]
        tok = out.token_ids[i].item()
        assert lp.token_ids[0] == tok and len(lp.token_ids) == len(lp.logprobs) == 1 + k
        assert lp.logprobs[0] == pytest.approx(ref[i, tok].item(), abs=1e-6)
        order = ref[i].argsort(descending=True).tolist()
        assert lp.rank == order.index(tok) + 1
        assert lp.token_ids[1:] == order[:k]
        torch.testing.assert_close(torch.tensor(lp.logprobs[1:]), ref[i, order[:k]])


def test_compute_logprobs_ranks_and_top():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    lps = compute_logprobs(logits, torch.tensor([2, 0]), [2, 1])
    ref = torch.log_softmax(logits, dim=-1)
    assert [lp.rank for lp in lps] == [3, 1]
    assert lps[0].token_ids == [2, 1, 3] and lps[1].token_ids == [0, 0]
    torch.testing.assert_close(torch.tensor(lps[0].logprobs), ref[0, [2, 1, 3]])
    assert compute_logprobs(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), []) == []
