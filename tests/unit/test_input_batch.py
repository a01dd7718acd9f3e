"""The persistent batch (tidal/executor/input_batch.py) against the list-based build it
replaced, step by step over random add / finish / preempt / chunked-prefill sequences."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.executor import input_batch
from tidal.executor.batch import ScheduledRequest, SchedulerOutput
from tidal.executor.input_batch import InputBatch, Inputs, prepare_inputs_reference, row_info
from tidal.layers.attention import AttentionMetadata
from tidal.layers.sampler import SamplingMetadata
from tidal.sampling_params import SamplingParams

VOCAB = 100


class FakeRequest:
    """A ``RunnerRequest`` whose progress the test drives (as the scheduler would)."""

    def __init__(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.request_id = rid
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt)
        self.block_ids: list[int] = []
        self.sampling_params = params
        self.eos_token_id = 1
        self.computed = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def resent(self) -> FakeRequest:
        """A worker's fresh copy (``step_wire`` resends a request): new objects, same state."""
        copy = FakeRequest(self.request_id, self.prompt_token_ids, self.sampling_params)
        copy.output_token_ids = list(self.output_token_ids)
        copy.all_token_ids = list(self.all_token_ids)
        copy.block_ids = list(self.block_ids)
        copy.computed = self.computed
        return copy


def _tensor_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


def _assert_same_attn(got: AttentionMetadata, want: AttentionMetadata) -> None:
    assert (got.num_tokens, got.block_size) == (want.num_tokens, want.block_size)
    assert (got.query_lens, got.seq_lens) == (want.query_lens, want.seq_lens)
    _tensor_equal(got.slot_mapping, want.slot_mapping)
    if isinstance(want.decode_rows, slice) or want.decode_rows is None:
        assert got.decode_rows == want.decode_rows
    else:
        assert isinstance(got.decode_rows, torch.Tensor)
        _tensor_equal(got.decode_rows, want.decode_rows)
    _tensor_equal(got.decode_block_table, want.decode_block_table)
    _tensor_equal(got.decode_seq_lens, want.decode_seq_lens)
    _tensor_equal(got.decode_mask, want.decode_mask)
    if want.decode_block_table is not None:  # the mask (built on first read) from its definition
        assert want.decode_seq_lens is not None
        width = want.decode_block_table.shape[1] * want.block_size
        mask = torch.arange(width)[None, :] < want.decode_seq_lens[:, None]
        if bool(mask.all()):
            assert want.decode_mask is None
        else:
            assert want.decode_mask is not None
            assert torch.equal(want.decode_mask[:, 0, 0], mask)
    assert len(got.prefills) == len(want.prefills)
    for g, w in zip(got.prefills, want.prefills):
        assert (g.rows, g.start) == (w.rows, w.start)
        _tensor_equal(g.kv_blocks, w.kv_blocks)
        _tensor_equal(g.mask, w.mask)
    assert len(got.groups) == len(want.groups)
    for g, w in zip(got.groups[1:], want.groups[1:]):  # group 0's is the one compared above
        _assert_same_attn(g, w)


def _assert_same(got: Inputs, want: Inputs) -> None:
    _tensor_equal(got.input_ids, want.input_ids)
    _tensor_equal(got.positions, want.positions)
    _assert_same_attn(got.attn, want.attn)
    assert got.sample_rows.tolist() == want.sample_rows.tolist()
    assert [sr.request for sr in got.sample_reqs] == [sr.request for sr in want.sample_reqs]
    assert [(sr.request, a, b) for sr, a, b in got.prompt_lp] == [
        (sr.request, a, b) for sr, a, b in want.prompt_lp
    ]
    assert got.placeholders == want.placeholders


@pytest.mark.parametrize("seed", range(6))
def test_persistent_batch_equals_the_list_build(seed: int) -> None:
    """Odd seeds: two KV cache groups, whose tables ``block_ids`` interleaves (one
    metadata each)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    groups = 1 + seed % 2
    free = list(range(1, 8000))
    rng.shuffle(free)  # scattered block ids, as a used cache hands them out
    # Few rows and 16 columns to start: growth and reclaiming rows are exercised too.
    batch = InputBatch(block_size, VOCAB, "cpu", max_rows=2)
    batch.num_kv_groups = groups
    running: list[FakeRequest] = []
    finished: set[str] = set()
    preempted: set[str] = set()
    for step in range(40):
        for _ in range(rng.randint(0, 3)):  # arrivals
            params = SamplingParams(prompt_logprobs=2 if rng.random() < 0.2 else None)
            prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 70))]
            running.append(FakeRequest(f"s{step}-{len(running)}", prompt, params))
        for req in list(running):
            roll = rng.random()
            if roll < 0.06:  # finished: the scheduler reports it, its row goes
                running.remove(req)
                finished.add(req.request_id)
                free.extend(req.block_ids)
            elif roll < 0.12:  # preempted by recompute: blocks freed, a new list
                free.extend(req.block_ids)
                req.block_ids, req.computed = [], 0
                preempted.add(req.request_id)
            elif roll < 0.15:  # a worker's resent copy: no notice, new objects
                running[running.index(req)] = req.resent()
        scheduled: list[ScheduledRequest] = []
        late: list[FakeRequest] = []  # async scheduling: their token arrives after the step
        decodes_only = step % 3 == 2  # every request one token: prepare's own branch
        for req in running:
            if req.request_id in preempted or rng.random() < 0.1:  # not this step
                continue
            if decodes_only and req.computed < req.num_tokens - 1:  # a prefill: not now
                continue
            placeholder = False
            if req.computed == req.num_tokens:  # last step sampled: its token arrives
                placeholder = rng.random() < 0.3  # ... or, async, after this step
                if placeholder:
                    late.append(req)
                else:
                    tok = rng.randrange(2, VOCAB)
                    req.output_token_ids.append(tok)
                    req.all_token_ids.append(tok)
            n = 1 if placeholder else min(req.num_tokens - req.computed, rng.randint(1, 24))
            need = -(-(req.computed + n) // block_size) * groups - len(req.block_ids)
            req.block_ids.extend(free.pop() for _ in range(max(0, need)))
            if rng.random() < 0.1:  # a spare block (of each group) beyond the chunk's
                req.block_ids.extend(free.pop() for _ in range(groups))
            scheduled.append(ScheduledRequest(req, req.computed, n, placeholder))
            req.computed += n
        sched = SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=sum(s.num_new_tokens for s in scheduled),
            preempted_req_ids=preempted,
            finished_req_ids=finished,
        )
        finished, preempted = set(), set()
        if scheduled:
            want = prepare_inputs_reference(scheduled, block_size, VOCAB, "cpu", groups)
            assert len(want.attn.groups) == (groups if groups > 1 else 0)
            _assert_same(batch.prepare(sched), want)
            # A bare list (the runner's one-by-one retry) reads the same state.
            _assert_same(
                batch.prepare(scheduled[:1]),
                prepare_inputs_reference(scheduled[:1], block_size, VOCAB, "cpu", groups),
            )
        for req in late:
            tok = rng.randrange(2, VOCAB)
            req.output_token_ids.append(tok)
            req.all_token_ids.append(tok)


@pytest.mark.parametrize("seed", range(4))
def test_a_few_decodes_take_the_list_path_and_equal_the_array_path(seed: int, monkeypatch) -> None:
    """Decode steps of up to ``FEW_DECODES`` requests are built from Python lists
    (``_few_decodes``): tensor for tensor the array path's and the list build's, over
    steps that cross block boundaries (a row reading fewer blocks than the widest is
    padded), with spare blocks and a worker's resent copy; a larger step, a placeholder
    or a prompt-logprobs row takes the array path."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    few = InputBatch(block_size, VOCAB, "cpu")
    array = InputBatch(block_size, VOCAB, "cpu")
    taken: list[bool] = []
    real = InputBatch._few_decodes

    def spy(self, scheduled):
        out = real(self, scheduled)
        if self is few:
            taken.append(out is not None)
        return out

    monkeypatch.setattr(InputBatch, "_few_decodes", spy)
    free = list(range(1, 4000))
    rng.shuffle(free)
    limit = input_batch.FEW_DECODES
    reqs = []
    for i in range(limit + 1):
        r = FakeRequest(
            f"r{i}", [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 40))], SamplingParams()
        )
        r.block_ids = [
            free.pop() for _ in range(-(-r.num_tokens // block_size) + rng.randint(0, 1))
        ]
        reqs.append(r)
    for _ in range(30):
        n = rng.randint(1, limit + 1)
        if rng.random() < 0.1:
            reqs[0] = reqs[0].resent()
        batch = _decode_step(reqs[:n])
        for sr in batch:
            need = -(-(sr.start + 1) // block_size) - len(sr.request.block_ids)
            sr.request.block_ids.extend(free.pop() for _ in range(max(0, need)))
        want = prepare_inputs_reference(batch, block_size, VOCAB, "cpu")
        taken.clear()
        _assert_same(few.prepare(batch), want)
        assert taken == ([True] if n <= limit else [])
        monkeypatch.setattr(input_batch, "FEW_DECODES", 0)
        _assert_same(array.prepare(batch), want)
        monkeypatch.setattr(input_batch, "FEW_DECODES", limit)
        for r in reqs[n:]:  # the others stay in step: a token each
            r.output_token_ids.append(7)
            r.all_token_ids.append(7)
            need = -(-r.num_tokens // block_size) - len(r.block_ids)
            r.block_ids.extend(free.pop() for _ in range(max(0, need)))
    lp = FakeRequest("lp", [3, 4, 5], SamplingParams(prompt_logprobs=1))
    lp.block_ids = [free.pop() for _ in range(4)]  # its 4 tokens at any block size
    taken.clear()
    few.prepare(_decode_step([lp]))
    assert taken == [False]  # prompt logprobs: the array path
    r = reqs[0]
    placeholder = [ScheduledRequest(r, r.num_tokens, 1, True)]
    need = -(-(r.num_tokens + 1) // block_size) - len(r.block_ids)
    r.block_ids.extend(free.pop() for _ in range(max(0, need)))
    taken.clear()
    few.prepare(placeholder)
    assert taken == [False]  # a placeholder: the array path


def test_errors_match_the_list_build() -> None:
    req = FakeRequest("a", [5] * 20, SamplingParams())
    req.block_ids = [3]  # 20 tokens need 2 blocks of 16
    sched = [ScheduledRequest(req, 0, 20)]
    with pytest.raises(ValueError, match="20 tokens need 2 blocks of 16, got 1"):
        prepare_inputs_reference(sched, 16, VOCAB, "cpu")
    with pytest.raises(ValueError, match="20 tokens need 2 blocks of 16, got 1"):
        InputBatch(16, VOCAB, "cpu").prepare(sched)
    req.block_ids.append(4)
    req.all_token_ids[3] = VOCAB  # outside the vocabulary
    for build in (
        lambda: prepare_inputs_reference(sched, 16, VOCAB, "cpu"),
        lambda: InputBatch(16, VOCAB, "cpu").prepare(sched),
    ):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            build()


def _decode_step(reqs: list[FakeRequest]) -> list[ScheduledRequest]:
    for r in reqs:
        r.output_token_ids.append(7)
        r.all_token_ids.append(7)
    return [ScheduledRequest(r, r.num_tokens - 1, 1) for r in reqs]


def test_sampling_metadata_is_reused_only_while_nothing_depends_on_the_step() -> None:
    batch = InputBatch(16, VOCAB, "cpu")
    plain = [
        FakeRequest("g", [3, 4], SamplingParams(temperature=0.0)),
        FakeRequest("t", [3, 4], SamplingParams(temperature=0.7, top_k=5, top_p=0.9)),
    ]
    first = batch.sampling_metadata(_decode_step(plain), {}, "cpu")
    again = batch.sampling_metadata(_decode_step(plain), {}, "cpu")
    assert again is first  # same requests, nothing per step
    _tensor_equal(first.temperature, torch.tensor([1.0, 0.7]))
    _tensor_equal(first.top_k, torch.tensor([0, 5]))
    assert first.greedy_mask is not None and first.greedy_mask.tolist() == [True, False]
    # Another composition: rebuilt.
    other = batch.sampling_metadata(_decode_step(plain[:1]), {}, "cpu")
    assert other is not first and other.num_rows == 1 and other.all_greedy
    # A seeded row draws from a generator of its output position: rebuilt every step,
    # at the new position (migration-proof seeded sampling).
    seeded = plain + [FakeRequest("s", [3, 4], SamplingParams(temperature=1.0, seed=9))]
    step1 = _decode_step(seeded)
    m1 = batch.sampling_metadata(step1, {}, "cpu")
    fresh1 = SamplingMetadata.build([row_info(sr, None) for sr in step1], "cpu")
    assert m1.generators[2].initial_seed() == fresh1.generators[2].initial_seed()
    m2 = batch.sampling_metadata(_decode_step(seeded), {}, "cpu")
    assert m2 is not m1
    assert m2.generators[2].initial_seed() != m1.generators[2].initial_seed()
    # Penalties and min_tokens read the outputs: never reused.
    pen = [FakeRequest("p", [3, 4], SamplingParams(temperature=0.0, presence_penalty=0.5))]
    assert batch.sampling_metadata(_decode_step(pen), {}, "cpu") is not batch.sampling_metadata(
        _decode_step(pen), {}, "cpu"
    )
    # A grammar's bitmask changes every step: never reused.
    words = (VOCAB + 31) // 32
    mask = {"g": b"\xff" * 4 * words}
    b1 = batch.sampling_metadata(_decode_step(plain), mask, "cpu")
    b2 = batch.sampling_metadata(_decode_step(plain), mask, "cpu")
    assert b1 is not b2 and b1.masks is not None
