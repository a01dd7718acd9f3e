"""Token sampling: logits of the rows that sample this step -> one token id each.

API (the model runner calls these once per step)::

    meta = SamplingMetadata.build(rows: list[RowInfo], device)        # host-side prep
    out = Sampler()(logits,            # [N, V] float32, not modified
                    meta)              # -> SamplerOutput(token_ids [N] int64, logprobs)
    compute_logprobs(logits [M, V], token_ids [M] int64, num_top: list[int]) -> list[Logprobs]
    process_logits(logits, meta) -> [N, V] float32    # everything before the draw

Order of processing (as in vLLM):
grammar bitmask (structured outputs) -> allowed_token_ids -> bad words -> min_tokens
masking -> logit_bias -> repetition / frequency / presence penalties -> (greedy rows take
their argmax here) -> temperature -> min_p -> top_k -> top_p -> draw. (transformers
applies min_p last; the two orders keep different tokens only with min_p and top_p both
set, and an OpenAI-style server answers as vLLM does.)

The draw is an exponential race (Gumbel-max in log space): ``argmax(logits - log(E))``
with ``E ~ Exp(1)`` per token picks token ``i`` with probability ``softmax(logits)[i]``.
A seeded row's noise is a pure function of (seed, output position) (docs/architecture.md#elastic-migration): the
token at output position ``p`` (``len(output_token_ids)``, counting the outputs a resumed
request carried over) draws its ``[V]`` noise from a fresh generator seeded with
``position_seed(seed, p)``. So its tokens depend neither on which other rows share the
batch nor on the request's history on this engine: a request preempted and recomputed,
or resumed on another engine, samples exactly what it would have. Unseeded rows share
one vectorised draw from the device's global RNG.

Logprobs are those of the raw model distribution (``log_softmax`` of the logits before
any processing), as vLLM returns by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from tidal.protocol.messages import Logprobs
from tidal.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Exp(1) noise is clamped away from 0 so that log(E) stays finite: a masked (-inf)
# token must stay at -inf and never become NaN.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class RowInfo:
    """What the sampler needs to know about one sampling row."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    # Generated so far; its length is the output position of the token sampled now.
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    # Sampled but not yet in output_token_ids (async scheduling: the previous step's
    # token, still on the device): 0 or 1. Counted in the output position.
    num_pending_outputs: int = 0
    # The tokens its grammar allows now (structured outputs): [ceil(V / 32)] int32 as
    # little-endian bytes, bit t % 32 of word t // 32 = token t (the scheduler's).
    grammar_bitmask: bytes | None = None

    @property
    def output_position(self) -> int:
        """The output position of the token sampled now."""
        return len(self.output_token_ids) + self.num_pending_outputs


@dataclass
class PenaltyMetadata:
    """Penalty inputs of the rows that use any penalty (``M`` of the ``N`` rows)."""

    rows: Tensor  # [M] int64, indices into the batch
    repetition: Tensor  # [M] float32
    frequency: Tensor  # [M] float32
    presence: Tensor  # [M] float32
    # Token ids padded with -1; prompt ids only when some row has repetition_penalty != 1.
    prompt_ids: Tensor | None  # [M, Lp] int64
    output_ids: Tensor  # [M, Lo] int64


@dataclass
class SamplingMetadata:
    """Per-step tensors built from the rows' params. Greedy rows carry neutral values
    (temperature 1, no top-k/top-p/min-p) so the vectorised warpers leave them alone.
    A field is ``None`` when no row needs it, which skips that stage entirely."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_mask: Tensor | None  # [N] bool; None unless greedy and sampled rows are mixed
    temperature: Tensor | None  # [N] float32; None when every sampled row has T == 1
    top_k: Tensor | None  # [N] int64, 0 = disabled
    max_top_k: int  # largest enabled top_k (host side, so top-k needs no device sync)
    top_p: Tensor | None  # [N] float32, inf = disabled
    min_p: Tensor | None  # [N] float32, 0 = disabled
    # row -> a fresh generator for this step's draw, sampled seeded rows only
    generators: dict[int, torch.Generator]
    penalties: PenaltyMetadata | None
    # (row, token id) pairs to set to -inf because the row has not reached min_tokens.
    min_tokens_rows: list[int]
    min_tokens_ids: list[int]
    num_logprobs: list[int | None]  # per row: params.logprobs
    masks: MaskMetadata | None = None  # None when no row has a mask or a bias

    @property
    def fast_greedy(self) -> bool:
        """Plain argmax of the raw logits is the whole answer."""
        return (
            self.all_greedy
            and self.penalties is None
            and not self.min_tokens_rows
            and self.masks is None
        )

    @classmethod
    def build(cls, rows: list[RowInfo], device: torch.device | str) -> SamplingMetadata:
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        sampled = [not g for g in greedy]
        all_greedy, all_random = all(greedy), not any(greedy)

        def per_row(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        temperature = top_k = top_p = min_p = None
        max_top_k = max((p.top_k for s, p in zip(sampled, params) if s), default=0)
        if any(s and p.temperature != 1.0 for s, p in zip(sampled, params)):
            temps = [p.temperature if s else 1.0 for s, p in zip(sampled, params)]
            temperature = per_row(temps, torch.float32)
        if any(s and p.top_k > 0 for s, p in zip(sampled, params)):
            top_k = per_row([p.top_k if s else 0 for s, p in zip(sampled, params)], torch.int64)
        if any(s and p.top_p < 1.0 for s, p in zip(sampled, params)):
            tps = [
                p.top_p if s and p.top_p < 1.0 else float("inf") for s, p in zip(sampled, params)
            ]
            top_p = per_row(tps, torch.float32)
        if any(s and p.min_p > 0.0 for s, p in zip(sampled, params)):
            min_p = per_row([p.min_p if s else 0.0 for s, p in zip(sampled, params)], torch.float32)

        mt_rows, mt_ids = _min_tokens_pairs(rows)
        return cls(
            num_rows=len(rows),
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else per_row(greedy, torch.bool),
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators={
                i: position_generator(r.params.seed, r.output_position, device)
                for i, r in enumerate(rows)
                if sampled[i] and r.params.seed is not None
            },
            penalties=_build_penalties(rows, device),
            min_tokens_rows=mt_rows,
            min_tokens_ids=mt_ids,
            num_logprobs=[p.logprobs for p in params],
            masks=MaskMetadata.build(rows, device),
        )


@dataclass
class MaskMetadata:
    """The rows' token masks and biases; each part is None (or empty) when no row has it."""

    bitmask_rows: Tensor | None  # [G] int64, rows with a grammar; None: every row has one
    bitmask: Tensor | None  # [G, ceil(V / 32)] int32, their allowed tokens, packed
    allowed_rows: Tensor | None  # [A] int64, rows with allowed_token_ids
    allowed_pairs: Tensor | None  # [P, 2] int64 (index into allowed_rows, token id)
    banned_rows: list[int]  # (row, token) pairs a bad word bans now
    banned_ids: list[int]
    bias_rows: list[int]  # (row, token, bias) triples of logit_bias
    bias_ids: list[int]
    bias_values: list[float]

    @classmethod
    def build(cls, rows: list[RowInfo], device: torch.device | str) -> MaskMetadata | None:
        if not any(r.params.needs_logits_masks or r.grammar_bitmask is not None for r in rows):
            return None
        masked = [(i, r.grammar_bitmask) for i, r in enumerate(rows) if r.grammar_bitmask]
        grammar = [i for i, _ in masked]
        bitmask_rows = bitmask = None
        if masked:
            # [G, words] int32 (bytearray: frombuffer wants a writable buffer)
            words = [torch.frombuffer(bytearray(m), dtype=torch.int32) for _, m in masked]
            bitmask = torch.stack(words).to(device, non_blocking=True)
            if len(grammar) < len(rows):
                bitmask_rows = torch.tensor(grammar, dtype=torch.int64).to(device)
        allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
        allowed_rows = allowed_pairs = None
        if allowed:
            # Built by torch from each row's id list: a list as long as the vocabulary
            # costs no per-id Python work each step.
            ids = [torch.tensor(rows[i].params.allowed_token_ids or (), dtype=torch.int64)
                   for i in allowed]  # fmt: skip
            owner = torch.repeat_interleave(
                torch.arange(len(allowed)), torch.tensor([len(t) for t in ids])
            )
            allowed_rows = torch.tensor(allowed, dtype=torch.int64).to(device, non_blocking=True)
            allowed_pairs = torch.stack([owner, torch.cat(ids)], dim=1).to(device)  # [P, 2]
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, r in enumerate(rows):
            for t in banned_by_bad_words(r.params.bad_words_token_ids, r.output_token_ids):
                banned_rows.append(i)
                banned_ids.append(t)
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for i, r in enumerate(rows):
            for t, b in (r.params.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(t)
                bias_values.append(b)
        return cls(
            bitmask_rows=bitmask_rows,
            bitmask=bitmask,
            allowed_rows=allowed_rows,
            allowed_pairs=allowed_pairs,
            banned_rows=banned_rows,
            banned_ids=banned_ids,
            bias_rows=bias_rows,
            bias_ids=bias_ids,
            bias_values=bias_values,
        )


def banned_by_bad_words(words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """vLLM's rule: a word's last token is banned when the output so far ends with the
    word's other tokens (a one-token word is always banned)."""
    out: list[int] = []
    for w in words:
        prefix = w[:-1]
        if not prefix or (
            len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix) :] == prefix
        ):
            out.append(w[-1])
    return out


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, splitmix64's increment


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position ``position`` of a request seeded ``seed``
    (any int64): splitmix64 of ``seed ^ position * golden``, an unsigned 64-bit int.
    Fixed forever: changing it changes every seeded output."""
    z = ((seed & _MASK64) ^ (position * _GOLDEN & _MASK64)) + _GOLDEN & _MASK64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def position_generator(seed: int, position: int, device: torch.device | str) -> torch.Generator:
    """A fresh generator on ``device`` for the draw at (seed, output position)."""
    return torch.Generator(device=device).manual_seed(position_seed(seed, position))


def _min_tokens_pairs(rows: list[RowInfo]) -> tuple[list[int], list[int]]:
    """Stop tokens (EOS unless ignore_eos, plus stop_token_ids) of rows below min_tokens."""
    mt_rows: list[int] = []
    mt_ids: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if r.output_position >= p.min_tokens:
            continue
        ids = set(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            ids.add(r.eos_token_id)
        mt_rows.extend([i] * len(ids))
        mt_ids.extend(sorted(ids))
    return mt_rows, mt_ids


def _build_penalties(rows: list[RowInfo], device: torch.device | str) -> PenaltyMetadata | None:
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return None
    ps = [rows[i].params for i in idx]
    need_prompt = any(p.repetition_penalty != 1.0 for p in ps)

    def vec(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

    return PenaltyMetadata(
        rows=torch.tensor(idx, dtype=torch.int64).to(device, non_blocking=True),
        repetition=vec([p.repetition_penalty for p in ps]),
        frequency=vec([p.frequency_penalty for p in ps]),
        presence=vec([p.presence_penalty for p in ps]),
        prompt_ids=_pad([rows[i].prompt_token_ids for i in idx], device) if need_prompt else None,
        output_ids=_pad([rows[i].output_token_ids for i in idx], device),
    )


def _pad(seqs: list[list[int]], device: torch.device | str) -> Tensor:
    """[M, max_len] int64, padded with -1 (at least one column so scatters stay simple)."""
    width = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), width), -1, dtype=torch.int64)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
    return out.to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [N] int64
    logprobs: list[Logprobs | None]  # per row; None where the row did not ask


class Sampler:
    """Stateless; one instance per model runner."""

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == meta.num_rows, logits.shape
        if meta.fast_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = _sample(logits, meta)
        return SamplerOutput(token_ids=token_ids, logprobs=_row_logprobs(logits, token_ids, meta))


def _sample(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    x = logits.clone()
    apply_masks(x, meta.masks)
    apply_min_tokens(x, meta)
    apply_logit_bias(x, meta.masks)
    apply_penalties(x, meta)
    if meta.all_greedy:
        return x.argmax(dim=-1)
    greedy = None if meta.all_random else x.argmax(dim=-1)
    x = apply_warpers(x, meta)
    sampled = exponential_race(x, meta.generators)
    if greedy is None:
        return sampled
    assert meta.greedy_mask is not None  # mixed rows (all-greedy batches returned above)
    return torch.where(meta.greedy_mask, greedy, sampled)


def process_logits(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """All processing before the draw, on a copy: [N, V] float32 whose softmax is the
    distribution sampled rows draw from (greedy rows: argmax of this)."""
    x = logits.clone()
    apply_masks(x, meta.masks)
    apply_min_tokens(x, meta)
    apply_logit_bias(x, meta.masks)
    apply_penalties(x, meta)
    return apply_warpers(x, meta)


def apply_masks(x: Tensor, masks: MaskMetadata | None) -> None:
    """In place: -inf for the tokens a row's grammar, allowed_token_ids or bad words rule out."""
    if masks is None:
        return
    if masks.bitmask is not None:
        apply_token_bitmask(x, masks.bitmask_rows, masks.bitmask)
    vocab = x.shape[1]
    if masks.allowed_rows is not None and masks.allowed_pairs is not None:
        pairs = masks.allowed_pairs
        pairs = pairs[pairs[:, 1] < vocab]  # ids beyond the logits allow nothing
        keep = torch.zeros(masks.allowed_rows.shape[0], vocab, dtype=torch.bool, device=x.device)
        keep[pairs[:, 0], pairs[:, 1]] = True
        sub = x.index_select(0, masks.allowed_rows).masked_fill_(~keep, _NEG_INF)
        x.index_copy_(0, masks.allowed_rows, sub)
    _set_pairs(x, masks.banned_rows, masks.banned_ids, _NEG_INF)


def apply_token_bitmask(x: Tensor, rows: Tensor | None, bitmask: Tensor) -> None:
    """In place: rows ``rows`` ([G] int64; None = every row, G = N) of ``x`` ([N, V]) keep
    only the tokens whose bit is set in ``bitmask`` ([G, ceil(V / 32)] int32).

    On CPU in float32, xgrammar's own C++ kernel (one pass; ``apply_token_bitmask_torch``'s
    three torch passes over a [32, 4096] mask took 22-29 ms on 2 busy cores, the kernel
    0.3-0.4 ms); elsewhere, and as its reference, ``apply_token_bitmask_torch``."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        apply_token_bitmask_torch(x, rows, bitmask)
        return
    # A row with a bitmask has a grammar: xgrammar is loaded already.
    from xgrammar import apply_token_bitmask_inplace

    target = x if rows is None else x.index_select(0, rows)
    apply_token_bitmask_inplace(target, bitmask.contiguous(), vocab_size=x.shape[1], backend="cpu")
    if rows is not None:
        x.index_copy_(0, rows, target)


def apply_token_bitmask_torch(x: Tensor, rows: Tensor | None, bitmask: Tensor) -> None:
    """``apply_token_bitmask`` in plain torch, any device and dtype."""
    vocab = x.shape[1]
    # Little-endian words (CPUs and GPUs alike): token t is bit t % 8 of byte t // 8, so
    # the unpacked mask is one byte per token, not one int32.
    packed = bitmask.contiguous().view(torch.uint8)  # [G, 4 * words]
    bit = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8).to(x.device)
    blocked = ((packed[:, :, None] & bit) == 0).flatten(1)[:, :vocab]  # [G, V] bool
    if rows is None:
        x.masked_fill_(blocked, _NEG_INF)
        return
    sub = x.index_select(0, rows).masked_fill_(blocked, _NEG_INF)
    x.index_copy_(0, rows, sub)


def apply_logit_bias(x: Tensor, masks: MaskMetadata | None) -> None:
    """In place: add each row's logit_bias (ids beyond the logits are ignored)."""
    if masks is None or not masks.bias_rows:
        return
    vocab = x.shape[1]
    triples = [
        (r, t, b)
        for r, t, b in zip(masks.bias_rows, masks.bias_ids, masks.bias_values)
        if t < vocab
    ]
    if not triples:
        return
    idx = torch.tensor([(r, t) for r, t, _ in triples], dtype=torch.int64).to(x.device)  # [P, 2]
    bias = torch.tensor([b for _, _, b in triples], dtype=x.dtype).to(x.device)  # [P]
    x.index_put_((idx[:, 0], idx[:, 1]), bias, accumulate=True)


def _set_pairs(x: Tensor, rows: list[int], ids: list[int], value: float) -> None:
    vocab = x.shape[1]
    pairs = [(r, t) for r, t in zip(rows, ids) if t < vocab]
    if not pairs:
        return
    idx = torch.tensor(pairs, dtype=torch.int64).to(x.device, non_blocking=True)  # [P, 2]
    x[idx[:, 0], idx[:, 1]] = value


def apply_min_tokens(x: Tensor, meta: SamplingMetadata) -> None:
    """In place: block stop tokens of rows that have not yet produced min_tokens."""
    if not meta.min_tokens_rows:
        return
    vocab = x.shape[1]
    # Ids outside the vocabulary cannot be sampled anyway; indexing with them would fault.
    pairs = [(r, t) for r, t in zip(meta.min_tokens_rows, meta.min_tokens_ids) if t < vocab]
    if not pairs:
        return
    idx = torch.tensor(pairs, dtype=torch.int64).to(x.device, non_blocking=True)  # [P, 2]
    x[idx[:, 0], idx[:, 1]] = _NEG_INF


def apply_penalties(x: Tensor, meta: SamplingMetadata) -> None:
    """In place. Repetition penalty (transformers' rule) over prompt + output tokens:
    seen logits > 0 are divided by it, others multiplied. Then OpenAI-style
    ``logit -= frequency * count + presence * (count > 0)`` over output tokens."""
    pen = meta.penalties
    if pen is None:
        return
    vocab = x.shape[1]
    sub = x.index_select(0, pen.rows)  # [M, V]
    counts = _token_counts(pen.output_ids, vocab)  # [M, V] float32
    if pen.prompt_ids is not None:
        seen = (counts > 0) | (_token_counts(pen.prompt_ids, vocab) > 0)
        rep = pen.repetition[:, None]
        penalised = torch.where(sub < 0, sub * rep, sub / rep)
        sub = torch.where(seen, penalised, sub)
    sub = sub - (pen.frequency[:, None] * counts + pen.presence[:, None] * (counts > 0))
    x.index_copy_(0, pen.rows, sub)


def _token_counts(ids: Tensor, vocab: int) -> Tensor:
    """[M, L] int64 ids padded with -1 -> [M, V] float32 occurrence counts."""
    # Padding (-1) and ids beyond the vocabulary land in a spare last column, dropped after.
    safe = torch.where((ids < 0) | (ids >= vocab), vocab, ids)
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, safe, torch.ones_like(safe, dtype=torch.float32))
    return counts[:, :vocab]


def apply_warpers(x: Tensor, meta: SamplingMetadata) -> Tensor:
    """Temperature -> min_p -> top_k -> top_p (vLLM's order); may work in place on ``x``."""
    if meta.temperature is not None:
        x = x.div_(meta.temperature[:, None])
    if meta.min_p is not None:
        apply_min_p(x, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        apply_top_k_top_p(x, meta.top_k, meta.top_p, meta.max_top_k)
    return x


def apply_top_k_top_p(
    x: Tensor, top_k: Tensor | None, top_p: Tensor | None, max_top_k: int = 0
) -> None:
    """In place. Keeps logits >= the k-th largest (ties kept, like transformers), then the
    smallest prefix of the rest (by descending probability, renormalised after top-k)
    whose mass reaches top_p. Both stages become one cut-off logit per row."""
    vocab = x.shape[1]
    kth = None
    if top_k is not None:
        on = top_k > 0
        k = torch.where(on, top_k.clamp(max=vocab), 1)  # [N] int64, 1-based
        if top_p is None:
            # top-k alone: a partial top-k up to the largest k avoids a full sort.
            max_k = min(max_top_k, vocab) if max_top_k > 0 else int(k.max())
            vals = x.topk(max_k, dim=-1).values  # [N, max_k]
        else:
            vals, _ = x.sort(dim=-1, descending=True)  # [N, V]
        kth = vals.gather(1, (k - 1)[:, None])
        kth = torch.where(on[:, None], kth, _NEG_INF)  # [N, 1]
        if top_p is None:
            x.masked_fill_(x < kth, _NEG_INF)
            return
        vals = vals.masked_fill(vals < kth, _NEG_INF)
    else:
        vals, _ = x.sort(dim=-1, descending=True)  # [N, V]
    assert top_p is not None  # top-k alone returned above
    # Token i (descending) is kept iff the mass before it is < top_p: the first token
    # always stays. Counting "cumsum < p" avoids subtracting, so the count is monotone.
    cum = vals.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    n_keep = ((cum < top_p[:, None]).sum(dim=-1) + 1).clamp(max=vocab)  # [N]
    cutoff = vals.gather(1, (n_keep - 1)[:, None])  # [N, 1]
    if kth is not None:
        cutoff = torch.maximum(cutoff, kth)
    x.masked_fill_(x < cutoff, _NEG_INF)


def apply_min_p(x: Tensor, min_p: Tensor) -> None:
    """In place: drop tokens whose probability is below ``min_p`` times the top one."""
    probs = x.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    x.masked_fill_(probs < min_p[:, None] * top, _NEG_INF)


def exponential_race(x: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """[N, V] logits -> [N] int64 tokens drawn from softmax(x) per row. Seeded rows use
    only their own generator (one [V] draw from a fresh one each), so they are
    batch-independent."""
    noise = torch.empty_like(x)  # [N, V] Exp(1)
    if len(generators) < x.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return (x - noise.clamp_min_(_TINY).log_()).argmax(dim=-1)


def _row_logprobs(
    logits: Tensor, token_ids: Tensor, meta: SamplingMetadata
) -> list[Logprobs | None]:
    wanted = {i: k for i, k in enumerate(meta.num_logprobs) if k is not None}
    rows = list(wanted)
    out: list[Logprobs | None] = [None] * meta.num_rows
    if not rows:
        return out
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    computed = compute_logprobs(
        logits.index_select(0, idx),
        token_ids.index_select(0, idx),
        [wanted[i] for i in rows],
    )
    for i, lp in zip(rows, computed):
        out[i] = lp
    return out


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: list[int]) -> list[Logprobs]:
    """Logprobs of ``token_ids`` under ``log_softmax(logits)`` plus each row's top-k.

    logits: [M, V] float; token_ids: [M] int64; num_top: M ints >= 0 (clamped to V).
    Each result lists the chosen token first, then the top-k in descending order; rank is
    1 + the number of tokens strictly more likely than the chosen one.
    """
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    chosen = lp.gather(1, token_ids[:, None].long())  # [M, 1]
    rank = (lp > chosen).sum(dim=-1) + 1  # [M]
    max_k = min(max(num_top), lp.shape[1])
    if max_k > 0:
        top_vals, top_ids = lp.topk(max_k, dim=-1)  # [M, max_k]
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    else:
        top_vals_l = top_ids_l = [[] for _ in num_top]
    chosen_l, rank_l, ids_l = chosen[:, 0].tolist(), rank.tolist(), token_ids.tolist()
    out = []
    for i, k in enumerate(num_top):
        k = min(k, max_k)
        out.append(
            Logprobs(
                token_ids=[ids_l[i], *top_ids_l[i][:k]],
                logprobs=[chosen_l[i], *top_vals_l[i][:k]],
                rank=rank_l[i],
            )
        )
    return out
