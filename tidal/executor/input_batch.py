"""The persistent batch: a step's model inputs built from state kept across steps.

The runner used to rebuild every input from Python lists each step: a padded block
table from every request's list, one range of slots per block, one ``RowInfo`` and a
pass over every row's sampling params. ``InputBatch`` keeps instead, per request, a row
of a preallocated numpy block table, updated by diffs: a request's row gets only the
blocks appended since the last step (the scheduler only ever extends ``block_ids``, or
replaces the list when it frees them: a preemption, a resend to a worker); a finished
or preempted request's row is freed. Input ids, positions, slot mapping, the decode
block table and masks are then array operations over that table
(``AttentionMetadata.build_arrays``), and the sampling metadata is reused while the batch
is the same requests and nothing in it depends on the step (no seeded draw, penalty,
min_tokens, mask or grammar).

``prepare_inputs_reference`` is the list-based build the runner had, kept as the oracle:
tests/unit/test_input_batch.py drives both through random add / finish / preempt /
chunked-prefill steps and asserts identical tensors.

A row is found by request id and checked by identity (the same request object and the
same block list): a worker's copy of a request (``step_wire``) never sees the
scheduler's finish and preemption sets, so a stale row must be recognised on sight.
Rows of requests that stop being scheduled without a finish notice are reclaimed when
the table runs out of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tidal.executor.batch import ScheduledRequest, SchedulerOutput
from tidal.executor.graphs import DecodeStep
from tidal.layers.attention import AttentionMetadata
from tidal.layers.sampler import RowInfo, SamplingMetadata


@dataclass
class Inputs:
    """One step's model inputs, and what sampling needs to find its rows."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: np.ndarray  # [N] int64: flattened row of each sampling request's last token
    sample_reqs: list[ScheduledRequest]
    prompt_lp: list[tuple[ScheduledRequest, int, int]]  # (req, first row, count)
    # Async scheduling: (flattened row, request id) of each placeholder input id (0 here),
    # to be filled from the previous step's sampled ids.
    placeholders: list[tuple[int, str]] = field(default_factory=list)


def _check_vocab(ids_min: int, ids_max: int, vocab_size: int) -> None:
    # An out-of-range id would fault inside the forward (on CUDA a device assert that
    # poisons the context), where the request can no longer be singled out.
    if ids_min < 0 or ids_max >= vocab_size:
        raise ValueError(f"a token id is outside the vocabulary [0, {vocab_size})")


def _sampling_rows(
    scheduled: list[ScheduledRequest], row_of_first: list[int]
) -> tuple[list[int], list[ScheduledRequest], list[tuple[ScheduledRequest, int, int]]]:
    sample_rows: list[int] = []
    sample_reqs: list[ScheduledRequest] = []
    prompt_lp: list[tuple[ScheduledRequest, int, int]] = []
    for sr, row0 in zip(scheduled, row_of_first):
        req, start, n = sr.request, sr.start, sr.num_new_tokens
        if sr.placeholder or start + n == len(req.all_token_ids):  # sr.samples, inlined
            sample_rows.append(row0 + n - 1)
            sample_reqs.append(sr)
        if req.sampling_params.prompt_logprobs is not None:
            # Rows whose next token is still a prompt token get a prompt logprob.
            count = min(start + n, req.num_prompt_tokens - 1) - start
            if count > 0:
                prompt_lp.append((sr, row0, count))
    return sample_rows, sample_reqs, prompt_lp


def prepare_inputs_reference(
    scheduled: list[ScheduledRequest],
    block_size: int,
    vocab_size: int,
    device: Any,
    kv_groups: int = 1,
) -> Inputs:
    """The list-based build (one Python step per sequence and per block): the oracle.
    ``kv_groups``: ``block_ids`` interleaves that many tables, one metadata each."""
    ids: list[int] = []
    pos: list[int] = []
    seqs: list[tuple[int, int, list[int]]] = []
    firsts: list[int] = []
    placeholders: list[tuple[int, str]] = []
    for sr in scheduled:
        req, start, n = sr.request, sr.start, sr.num_new_tokens
        firsts.append(len(ids))
        if sr.placeholder:
            placeholders.append((len(ids), req.request_id))
            ids.append(0)
        else:
            ids.extend(req.all_token_ids[start : start + n])
        pos.extend(range(start, start + n))
        seqs.append((start, n, req.block_ids))
    if ids:
        _check_vocab(min(ids), max(ids), vocab_size)
    sample_rows, sample_reqs, prompt_lp = _sampling_rows(scheduled, firsts)
    return Inputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        attn=_reference_metadata(seqs, block_size, device, kv_groups),
        sample_rows=np.array(sample_rows, dtype=np.int64),
        sample_reqs=sample_reqs,
        prompt_lp=prompt_lp,
        placeholders=placeholders,
    )


def _reference_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: Any, kv_groups: int
) -> AttentionMetadata:
    if kv_groups == 1:
        return AttentionMetadata.build(seqs, block_size, device)
    return AttentionMetadata.grouped([
        AttentionMetadata.build([(s, n, b[g::kv_groups]) for s, n, b in seqs], block_size, device)
        for g in range(kv_groups)
    ])


# Up to this many requests a decode step is prepared from Python lists (``_few_decodes``).
FEW_DECODES = 4


@dataclass(frozen=True)
class _Gathered:
    """``InputBatch._gather``'s arrays for one step's requests."""

    starts: np.ndarray  # [num] int64
    num_new: np.ndarray  # [num] int64
    rows: np.ndarray  # [num] int64, block-table rows
    ids: np.ndarray  # [T] int64, placeholders 0
    firsts: list[int]  # each request's first row in ``ids``
    placeholders: list[tuple[int, str]]  # (row in ids, request id): filled by the runner
    sample_idx: list[int]  # requests that sample this step (a chunk's last, a placeholder)
    prompt_lp_idx: list[int]  # requests that asked for prompt logprobs
    decodes: int  # requests with one new token


@dataclass
class _Row:
    index: int  # row of the block table
    request: Any  # the request object the row was filled from
    blocks: list[int]  # its block list (the very object): replaced = resync
    num_blocks: int  # entries of ``blocks`` copied into the row


class InputBatch:
    """Per-request state across steps; ``prepare`` builds a step's ``Inputs`` from it."""

    def __init__(self, block_size: int, vocab_size: int, device: Any, max_rows: int = 64) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self._host = torch.device(device).type == "cpu"  # tensors made in place, no copy
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = list(range(max_rows - 1, -1, -1))
        self.block_table = np.zeros((max_rows, 16), dtype=np.int32)  # [rows, blocks]
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)  # [rows] valid entries
        # KV cache groups: a row interleaves their tables as ``block_ids`` does (entry
        # j * groups + g is group g's block j: tidal/engine_core/kv_cache.py).
        self.num_kv_groups = 1
        # The last static sampling metadata and the requests (objects) it was built for.
        self._sampling_key: tuple[Any, ...] = ()
        self._sampling: SamplingMetadata | None = None

    @property
    def num_rows(self) -> int:
        """Requests holding a row now."""
        return len(self._rows)

    # ---- diffs -------------------------------------------------------------------------

    def drop(self, request_ids: set[str]) -> None:
        """Free the rows of finished or preempted requests (the scheduler's notices)."""
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            if row is not None:
                self._free.append(row.index)

    def _row(self, req: Any, in_step: set[int]) -> int:
        """The table row of ``req``, its new blocks copied in (a fresh row if unknown or
        stale)."""
        rid = req.request_id
        blocks = req.block_ids
        row = self._rows.get(rid)
        if row is None or row.request is not req or row.blocks is not blocks:
            if row is not None:  # stale: its row is free again (so _take_row evicts nothing)
                self._free.append(row.index)
            row = self._rows[rid] = _Row(self._take_row(in_step), req, blocks, 0)
        n = len(blocks)
        if n < row.num_blocks:  # shrunk in place: never done, but never trusted either
            row.num_blocks = 0
        if n > row.num_blocks:
            if n > self.block_table.shape[1]:
                self._grow(cols=max(n, 2 * self.block_table.shape[1]))
            self.block_table[row.index, row.num_blocks : n] = blocks[row.num_blocks :]
            row.num_blocks = n
        self.num_blocks[row.index] = n
        return row.index

    def _row_index(self, req: Any, in_step: set[int]) -> int:
        """``_row``, where a decode's row usually needs nothing: the same request and block
        list, no block appended since the last step."""
        row = self._rows.get(req.request_id)
        if (
            row is not None
            and row.request is req
            and row.blocks is req.block_ids
            and row.num_blocks == len(row.blocks)
        ):
            return row.index
        return self._row(req, in_step)

    def _take_row(self, in_step: set[int]) -> int:
        if not self._free:
            # Rows of requests not in this step and never reported finished (a worker's
            # copies learn of finishes only by absence) go first; else the table grows.
            for rid, row in list(self._rows.items()):
                if row.index not in in_step:
                    del self._rows[rid]
                    self._free.append(row.index)
            if not self._free:
                old = self.block_table.shape[0]
                self._grow(rows=2 * old)
                self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        r, c = self.block_table.shape
        table = np.zeros((rows or r, cols or c), dtype=self.block_table.dtype)
        table[:r, :c] = self.block_table
        self.block_table = table
        num = np.zeros(rows or r, dtype=np.int64)
        num[:r] = self.num_blocks
        self.num_blocks = num

    # ---- a step ------------------------------------------------------------------------

    def _scheduled(self, sched: SchedulerOutput | list[ScheduledRequest]) -> list[ScheduledRequest]:
        if isinstance(sched, SchedulerOutput):
            self.drop(sched.finished_req_ids)
            self.drop(sched.preempted_req_ids)
            return sched.scheduled
        return sched

    def _gather(self, scheduled: list[ScheduledRequest]) -> _Gathered:
        """Per request: start, new tokens and table row (their new blocks copied in);
        the flattened token ids [T] (checked against the vocabulary), each request's
        first row in them, and what sampling needs (placeholders, known tokens)."""
        # Python lists, turned into arrays once: a numpy item store costs more than the
        # append (this loop runs once per request per step).
        starts_l: list[int] = []
        num_new_l: list[int] = []
        rows_l: list[int] = []
        ids: list[int] = []
        firsts: list[int] = []
        in_step: set[int] = set()
        placeholders: list[tuple[int, str]] = []
        sample_idx: list[int] = []
        prompt_lp_idx: list[int] = []  # the requests that asked for prompt logprobs
        decodes = 0
        for i, sr in enumerate(scheduled):
            req, start, n = sr.request, sr.start, sr.num_new_tokens
            starts_l.append(start)
            num_new_l.append(n)
            # What _sampling_rows finds (the reference's): a chunk that reaches its last
            # known token samples, and so does a placeholder (past the known ones).
            if sr.placeholder or start + n == len(req.all_token_ids):
                sample_idx.append(i)
            if req.sampling_params.prompt_logprobs is not None:
                prompt_lp_idx.append(i)
            index = self._row_index(req, in_step)
            rows_l.append(index)
            in_step.add(index)
            firsts.append(len(ids))
            if n == 1:  # a decode: one token, no slice
                decodes += 1
                if sr.placeholder:  # not known here yet: the runner fills it in
                    placeholders.append((len(ids), req.request_id))
                    ids.append(0)
                else:
                    ids.append(req.all_token_ids[start])
            else:
                ids.extend(req.all_token_ids[start : start + n])
        ids_np = np.array(ids, dtype=np.int64)  # [T]
        if len(ids) > 64:
            _check_vocab(int(ids_np.min()), int(ids_np.max()), self.vocab_size)
        elif ids:  # a few ids: Python's min and max cost less than numpy's
            _check_vocab(min(ids), max(ids), self.vocab_size)
        return _Gathered(
            np.array(starts_l, dtype=np.int64), np.array(num_new_l, dtype=np.int64),
            np.array(rows_l, dtype=np.int64), ids_np, firsts, placeholders, sample_idx,
            prompt_lp_idx, decodes,
        )  # fmt: skip

    def prepare(self, sched: SchedulerOutput | list[ScheduledRequest]) -> Inputs:
        """This step's inputs. A ``SchedulerOutput`` also frees the rows of its finished
        and preempted requests first; a bare list (a retry of some of a step's requests)
        frees nothing."""
        scheduled = self._scheduled(sched)
        num = len(scheduled)
        if num <= FEW_DECODES and self._host and self.num_kv_groups == 1:
            few = self._few_decodes(scheduled)
            if few is not None:
                return few
        g = self._gather(scheduled)
        starts, num_new, rows, ids_np, firsts = g.starts, g.num_new, g.rows, g.ids, g.firsts
        bs = self.block_size
        if num and g.decodes == num:  # token i is request i: fewer array operations
            width = (int(starts.max()) + bs) // bs  # blocks of the longest, after its token
            positions = starts
            sample_rows = np.array(g.sample_idx, dtype=np.int64)
        else:
            # Only the columns this step reads: a long context's spare blocks are not copied.
            width = int(((starts + num_new + (bs - 1)) // bs).max()) if num else 0
            first_row = np.asarray(firsts, dtype=np.int64)
            seq = np.repeat(np.arange(num), num_new)
            positions = np.arange(len(ids_np)) - first_row[seq] + starts[seq]  # [T]
            sample_rows = (first_row + num_new - 1)[g.sample_idx]
        if self.num_kv_groups == 1:
            attn = AttentionMetadata.build_arrays(
                starts, num_new, self.block_table[rows, :width], self.num_blocks[rows], bs,
                self.device,
            )  # fmt: skip
        else:
            attn = self._group_metadata(starts, num_new, rows, width)
        prompt_lp: list[tuple[ScheduledRequest, int, int]] = []
        if g.prompt_lp_idx:  # the few requests with prompt logprobs: the reference's way
            _, _, prompt_lp = _sampling_rows(
                [scheduled[i] for i in g.prompt_lp_idx], [firsts[i] for i in g.prompt_lp_idx]
            )
        sample_reqs = (
            list(scheduled) if len(g.sample_idx) == num else [scheduled[i] for i in g.sample_idx]
        )
        return Inputs(
            input_ids=torch.from_numpy(ids_np).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            attn=attn,
            sample_rows=sample_rows,
            sample_reqs=sample_reqs,
            prompt_lp=prompt_lp,
            placeholders=g.placeholders,
        )

    def _few_decodes(self, scheduled: list[ScheduledRequest]) -> Inputs | None:
        """``prepare`` for a few decode requests on the host (each one new token that
        samples, no placeholder, no prompt logprobs; one KV cache group), from Python lists
        and one array: at batch 1 each numpy reduction or array costs 10-15 us on the
        caches a forward leaves cold, and the array path spends about twenty of them. The
        same tensors as the array path (tests/unit/test_input_batch.py). None: another
        step, for the array path (the rows synced here are synced for it too)."""
        bs = self.block_size
        ids: list[int] = []
        starts: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        in_step: set[int] = set()
        for i, sr in enumerate(scheduled):
            req, start = sr.request, sr.start
            tokens = req.all_token_ids
            if (
                sr.num_new_tokens != 1
                or sr.placeholder
                or start + 1 != len(tokens)
                or req.sampling_params.prompt_logprobs is not None
            ):
                return None
            in_step.add(self._row_index(req, in_step))  # the table stays in sync
            blocks = req.block_ids
            need = start // bs + 1  # start >= 0: it is the last of the request's tokens
            if len(blocks) < need:
                raise ValueError(
                    f"sequence {i}: {start + 1} tokens need {need} blocks of {bs}, "
                    f"got {len(blocks)}"
                )
            ids.append(tokens[start])
            starts.append(start)
            slots.append(blocks[need - 1] * bs + start % bs)
            tables.append(blocks[:need])
        if not ids:
            return None
        _check_vocab(min(ids), max(ids), self.vocab_size)
        num = len(ids)
        width = max(len(t) for t in tables)
        lens = [s + 1 for s in starts]
        flat = ids + starts + slots + lens  # then the table, short rows padded with block 0
        for t in tables:
            flat += t
            flat += [0] * (width - len(t))
        arr = np.array(flat, dtype=np.int64)
        parts = [torch.from_numpy(arr[k * num : (k + 1) * num]) for k in range(4)]
        attn = AttentionMetadata(
            num_tokens=num,
            block_size=bs,
            slot_mapping=parts[2],
            query_lens=[1] * num,
            seq_lens=lens,
            decode_rows=slice(0, num),
            decode_block_table=torch.from_numpy(arr[4 * num :].reshape(num, width)),
            decode_seq_lens=parts[3],
        )
        attn._mask_pending = min(lens) != width * bs
        return Inputs(
            input_ids=parts[0],
            positions=parts[1],
            attn=attn,
            sample_rows=np.arange(num, dtype=np.int64),
            sample_reqs=list(scheduled),
            prompt_lp=[],
        )

    def _group_metadata(
        self,
        starts: np.ndarray,  # [S] int64
        num_new: np.ndarray,  # [S] int64
        rows: np.ndarray,  # [S] int64 table rows
        width: int,  # blocks per group the step reads
    ) -> AttentionMetadata:
        """One metadata per KV cache group, each from its columns of the rows; group 0's
        carries them all (``AttentionMetadata.groups``)."""
        groups = self.num_kv_groups
        table = self.block_table[rows, : width * groups]  # [S, width * groups]
        num_blocks = self.num_blocks[rows] // groups  # [S] per group
        return AttentionMetadata.grouped([
            AttentionMetadata.build_arrays(
                starts, num_new, table[:, g::groups], num_blocks, self.block_size, self.device
            )
            for g in range(groups)
        ])

    def prepare_decode(self, sched: SchedulerOutput | list[ScheduledRequest]) -> DecodeStep:
        """A decode-only step (every request one new token) as arrays, for the static
        buffers of a graph (tidal/executor/graphs.py); the same checks as ``prepare``."""
        scheduled = self._scheduled(sched)
        g = self._gather(scheduled)
        starts, num_new, rows, ids_np, firsts = g.starts, g.num_new, g.rows, g.ids, g.firsts
        if (num_new != 1).any():
            raise ValueError("prepare_decode takes decode-only steps")
        groups = self.num_kv_groups  # a row interleaves their tables
        short = np.flatnonzero(self.num_blocks[rows] // groups < starts // self.block_size + 1)
        if short.size:
            i = int(short[0])
            raise ValueError(f"sequence {i}: {starts[i] + 1} tokens need more blocks")
        width = (int(starts.max()) // self.block_size + 1 if len(starts) else 1) * groups
        sample_rows, sample_reqs, prompt_lp = _sampling_rows(scheduled, firsts)
        return DecodeStep(
            ids=ids_np,
            starts=starts,
            table=self.block_table[rows, :width],
            sample_rows=sample_rows,
            sample_reqs=sample_reqs,
            prompt_lp=prompt_lp,
            placeholders=g.placeholders,
        )

    def sampling_metadata(
        self, reqs: list[ScheduledRequest], bitmasks: dict[str, bytes], device: Any
    ) -> SamplingMetadata:
        """``SamplingMetadata.build`` for ``reqs``, reused while the sampling rows are the
        same request objects and none of it depends on the step: no seeded draw (its
        generator is per output position), penalty or min_tokens (they read the outputs),
        mask or grammar bitmask."""
        key = tuple(sr.request for sr in reqs)
        if not bitmasks and self._sampling is not None and key == self._sampling_key:
            return self._sampling
        infos = [row_info(sr, bitmasks.get(sr.request.request_id)) for sr in reqs]
        meta = SamplingMetadata.build(infos, device)
        static = (
            not meta.generators
            and meta.penalties is None
            and not meta.min_tokens_rows
            and all(sr.request.sampling_params.min_tokens == 0 for sr in reqs)
            and meta.masks is None
        )
        self._sampling_key, self._sampling = (key, meta) if static else ((), None)
        return meta


def row_info(sr: ScheduledRequest, bitmask: bytes | None) -> RowInfo:
    """What the sampler reads of one sampling request."""
    req = sr.request
    return RowInfo(
        params=req.sampling_params,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        eos_token_id=req.eos_token_id,
        num_pending_outputs=int(sr.placeholder),  # the placeholder is an output too
        grammar_bitmask=bitmask,
    )
