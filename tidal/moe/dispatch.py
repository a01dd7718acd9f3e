"""Expert-parallel token dispatchers (``--all2all-backend``): move tokens to the ranks that
own their experts, and the expert outputs back.

Contract (every backend, every EP rank, every forward — idle ranks run a dummy batch of 0
or 1 tokens so each rank enters each collective in the same order)::

    res = dispatcher.dispatch(hidden,          # [T, H] this rank's tokens
                              topk_weights,    # [T, K] float32
                              topk_ids,        # [T, K] int64 logical expert ids
                              num_tokens_across_dp=None)  # optional [ep] tokens per rank
    out = experts(res.hidden, w13, w2, res.topk_weights, res.topk_ids,
                  dispatcher.expert_map, apply_router_weight=True)   # [T', H]
    y = dispatcher.combine(out, res.handle)    # [T, H], this rank's tokens, fully reduced

``res`` is a ``DispatchResult`` NamedTuple ``(hidden, topk_weights, topk_ids, handle)``:
``hidden [T', H]`` (dtype of the input), ``topk_weights [T', K'] float32``,
``topk_ids [T', K'] int64`` *logical* ids. ``dispatcher.expert_map [E] int32`` is this
rank's logical id -> local slot (or -1) map, the same as
``FusedMoE.build_expert_map(E, placement.local_expert_ids(rank))``.

Who applies the top-k weights: the **experts** do (``apply_router_weight=True``), for
every backend here; ``combine`` only sums. Slots this rank must not compute (expert on
another rank, or a replica chosen elsewhere) arrive with weight 0 and an id this rank does
not hold, so the expert kernel skips them.

Replicas (``placement.py``): the origin rank rewrites each (token, k) to exactly one
physical copy — its own copy if it has one, else ``(row + origin) % n_replicas`` — so
each pair is computed once however many copies exist.

Backends:
- ``allgather_reducescatter``: all-gather every rank's tokens (padded to the max count),
  compute the local share of all of them, reduce-scatter (sum) back. Traffic per rank
  ~ (ep-1) * max_tokens * (row bytes) each way; simple and fine for small decode batches.
- ``all2all``: a token goes only to the ranks that own one of its chosen copies, once per
  rank (all its k slots for that rank ride together); counts are exchanged first, then
  one ``all_to_all_single`` each way. Traffic ~ tokens * distinct-ranks * row bytes.
- ``deepep_high_throughput`` / ``deepep_low_latency``: DeepEP buffers (CUDA only). Written
  from DeepEP's documented ``Buffer`` API and **untested here** (no GPU in CI).

Row packing: hidden, physical ids (int32) and weights (float32) travel as one uint8 row
(``H * elem + 8K`` bytes) so each direction costs one collective, not three.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from tidal.moe.placement import ExpertPlacement


class DispatchResult(NamedTuple):
    hidden: Tensor  # [T', H] rows this rank's experts process
    topk_weights: Tensor  # [T', K'] float32, 0 for slots computed elsewhere
    topk_ids: Tensor  # [T', K'] int64 logical ids (a non-local id where masked)
    handle: Any  # backend state for combine


@dataclasses.dataclass
class CommStats:
    """Payload bytes this rank sent to / received from *other* ranks (self excluded),
    summed over calls; metadata (counts, ids, weights) included."""

    calls: int = 0
    tokens: int = 0  # this rank's tokens dispatched
    dispatch_sent: int = 0
    dispatch_recv: int = 0
    combine_sent: int = 0
    combine_recv: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.dispatch_sent + self.dispatch_recv + self.combine_sent + self.combine_recv

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


# ---------------------------------------------------------------------------- routing


class ReplicaRouter:
    """Tensor form of ``ExpertPlacement.route`` and of the per-rank masking."""

    def __init__(self, placement: ExpertPlacement, rank: int) -> None:
        self.placement = placement
        self.rank = rank
        p = placement
        E = p.num_logical_experts
        self._phys_rank = torch.tensor([p.rank_of(x) for x in range(p.num_physical_experts)])
        self._phys_logical = torch.tensor(p.physical_to_logical, dtype=torch.int64)
        self._local_copy = torch.tensor(
            [[p.local_physical(r, e) for e in range(E)] for r in range(p.ep_size)]
        )  # [ep, E] physical id of rank r's copy, or -1
        reps = p.logical_to_physical
        width = max(len(r) for r in reps)
        self._replicas = torch.tensor([list(r) + [r[0]] * (width - len(r)) for r in reps])  # [E, W]
        self._num_reps = torch.tensor([len(r) for r in reps])  # [E]
        held = set(p.local_expert_ids(rank))
        # An id this rank does not hold: masked slots map to -1 in its expert map. When the
        # rank holds every expert there is none; weight 0 alone then zeroes the slot.
        self.sentinel = next((e for e in range(E) if e not in held), 0)
        self.expert_map = torch.tensor(p.expert_map_for_rank(rank), dtype=torch.int32)  # [E]
        self._device: torch.device | None = None

    def to(self, device: torch.device) -> ReplicaRouter:
        if self._device != device:
            for name in ("_phys_rank", "_phys_logical", "_local_copy", "_replicas", "_num_reps"):
                setattr(self, name, getattr(self, name).to(device))
            self.expert_map = self.expert_map.to(device)
            self._device = device
        return self

    def route(self, topk_ids: Tensor) -> Tensor:  # [T, K] logical -> [T, K] int64 physical
        ids = topk_ids.to(torch.int64)
        local = self._local_copy[self.rank][ids]
        row = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        pick = (row + self.rank) % self._num_reps[ids]
        return torch.where(local >= 0, local, self._replicas[ids, pick])

    def dest_rank(self, phys: Tensor) -> Tensor:  # [T, K] physical -> owning rank
        return self._phys_rank[phys]

    def localize(self, phys: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Physical ids of received rows -> (logical ids, weights) for this rank's experts:
        slots whose chosen copy is elsewhere get the sentinel id and weight 0."""
        mine = self._phys_rank[phys] == self.rank
        ids = torch.where(mine, self._phys_logical[phys], torch.full_like(phys, self.sentinel))
        return ids, torch.where(mine, weights, torch.zeros_like(weights))


# ---------------------------------------------------------------------------- packing


def _pack(hidden: Tensor, phys: Tensor, weights: Tensor) -> Tensor:
    """[N, H] x [N, K] x [N, K] -> [N, H*elem + 8K] uint8 rows."""
    parts = [
        hidden.contiguous().view(torch.uint8),
        phys.to(torch.int32).contiguous().view(torch.uint8),
        weights.to(torch.float32).contiguous().view(torch.uint8),
    ]
    return torch.cat(parts, dim=1)


def _unpack(
    rows: Tensor, hidden_size: int, dtype: torch.dtype, k: int
) -> tuple[Tensor, Tensor, Tensor]:
    hb = hidden_size * torch.empty((), dtype=dtype).element_size()
    hidden = rows[:, :hb].contiguous().view(dtype)
    phys = rows[:, hb : hb + 4 * k].contiguous().view(torch.int32).to(torch.int64)
    weights = rows[:, hb + 4 * k :].contiguous().view(torch.float32)
    return hidden, phys, weights


# ---------------------------------------------------------------------------- groups


class _SoloGroup:
    """The EP group of one rank (``group=None``): every collective is a copy."""

    rank = 0
    world_size = 1

    def all_gather_v(self, t: Tensor, sizes: Sequence[int]) -> Tensor:
        return t.clone()

    def all_gather(self, t: Tensor) -> Tensor:
        return t.clone()

    def reduce_scatter_v(self, t: Tensor, sizes: Sequence[int]) -> Tensor:
        return t.clone()

    def all_to_all_single(
        self, out: Tensor, inp: Tensor, out_splits: Any = None, in_splits: Any = None
    ) -> Tensor:
        return out.copy_(inp)


# ---------------------------------------------------------------------------- base


class Dispatcher(ABC):
    """Base: holds the group, the placement, the replica router and the byte counter."""

    name: ClassVar[str]

    def __init__(self, group: Any, placement: ExpertPlacement) -> None:
        if group is None:
            group = _SoloGroup()
        if group.world_size != placement.ep_size:
            raise ValueError(
                f"{self.name}: EP group has {group.world_size} ranks but the placement is "
                f"for ep_size={placement.ep_size}"
            )
        self.group = group
        self.rank: int = group.rank
        self.ep_size: int = group.world_size
        self.stats = CommStats()
        self.set_placement(placement)

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Install a new placement (EPLB step or elastic commit) for later forwards."""
        if placement.ep_size != self.ep_size:
            raise ValueError(f"placement ep_size {placement.ep_size} != group size {self.ep_size}")
        self.placement = placement
        self.router = ReplicaRouter(placement, self.rank)

    @property
    def expert_map(self) -> Tensor:  # [E] int32 logical id -> local slot or -1
        return self.router.expert_map

    @property
    def local_expert_ids(self) -> list[int]:
        return self.placement.local_expert_ids(self.rank)

    def _tokens_per_rank(
        self, num_tokens: int, given: Sequence[int] | None, device: torch.device
    ) -> list[int]:
        """Use the counts agreed before the forward, else exchange them (one small all-gather)."""
        if given is not None:
            sizes = [int(n) for n in given]
            if len(sizes) != self.ep_size or sizes[self.rank] != num_tokens:
                raise ValueError(
                    f"num_tokens_across_dp={sizes} does not fit rank {self.rank} with "
                    f"{num_tokens} tokens in an EP group of {self.ep_size}"
                )
            return sizes
        counts = self.group.all_gather(torch.tensor([num_tokens], dtype=torch.int64, device=device))
        self.stats.dispatch_sent += 8 * (self.ep_size - 1)
        self.stats.dispatch_recv += 8 * (self.ep_size - 1)
        return [int(n) for n in counts.tolist()]

    @abstractmethod
    def dispatch(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 logical ids
        num_tokens_across_dp: Sequence[int] | None = None,  # [ep]
    ) -> DispatchResult: ...

    @abstractmethod
    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:  # [T', H] -> [T, H]
        ...

    @staticmethod
    def _handle(handle: Any) -> Any:
        return handle.handle if isinstance(handle, DispatchResult) else handle


# ---------------------------------------------------------------------------- all-gather


@dataclasses.dataclass
class _AGHandle:
    sizes: list[int]
    hidden_size: int


class AllGatherReduceScatterDispatcher(Dispatcher):
    """All-gather tokens + routing, compute the local share for all, reduce-scatter (sum).

    dispatch -> hidden [sum(sizes), H] (every rank's tokens in rank order), topk ids/weights
    [sum(sizes), K] with the slots of other ranks masked. combine: [sum(sizes), H] partial
    sums -> [T, H] summed over ranks. Padding to max(sizes) is the cost of equal-size
    collectives; a rank with 0 tokens still takes part.
    """

    name = "allgather_reducescatter"

    def dispatch(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 logical ids
        num_tokens_across_dp: Sequence[int] | None = None,  # [ep]
    ) -> DispatchResult:
        T, H = hidden.shape
        K = topk_ids.shape[1]
        router = self.router.to(hidden.device)
        sizes = self._tokens_per_rank(T, num_tokens_across_dp, hidden.device)
        packed = _pack(hidden, router.route(topk_ids), topk_weights)  # [T, row] uint8
        gathered = self.group.all_gather_v(packed, sizes)
        x, phys, weights = _unpack(gathered, H, hidden.dtype, K)
        ids, weights = router.localize(phys, weights)
        peers, row = self.ep_size - 1, packed.shape[1]
        self.stats.calls += 1
        self.stats.tokens += T
        self.stats.dispatch_sent += peers * max(sizes) * row
        self.stats.dispatch_recv += peers * max(sizes) * row
        return DispatchResult(x, weights, ids, _AGHandle(sizes, H))

    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:
        h: _AGHandle = self._handle(handle)
        peer_bytes = (self.ep_size - 1) * max(h.sizes) * h.hidden_size * expert_out.element_size()
        self.stats.combine_sent += peer_bytes
        self.stats.combine_recv += peer_bytes
        return self.group.reduce_scatter_v(expert_out, h.sizes)


# ---------------------------------------------------------------------------- all-to-all


@dataclasses.dataclass
class _A2AHandle:
    token_idx: Tensor  # [N_send] int64: origin row of each sent row, grouped by dest rank
    send_counts: list[int]  # [ep] rows sent to each rank
    recv_counts: list[int]  # [ep] rows received from each rank
    num_tokens: int


class AllToAllDispatcher(Dispatcher):
    """Send each token once to each rank owning one of its chosen copies.

    dispatch -> hidden [N_recv, H]: rows from rank 0 first, then rank 1, ... (origin order
    within a rank), each with all K ids of the token (other ranks' slots masked). combine:
    [N_recv, H] weighted partial sums go back the same way and are summed per token at the
    origin in float32 -> [T, H].
    """

    name = "all2all"

    def dispatch(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 logical ids
        num_tokens_across_dp: Sequence[int] | None = None,  # [ep]
    ) -> DispatchResult:
        T, H = hidden.shape
        K = topk_ids.shape[1]
        router = self.router.to(hidden.device)
        if num_tokens_across_dp is not None:
            self._tokens_per_rank(T, num_tokens_across_dp, hidden.device)  # validates only
        phys = router.route(topk_ids)  # [T, K]
        to_rank = torch.zeros((T, self.ep_size), dtype=torch.bool, device=hidden.device)
        to_rank.scatter_(1, router.dest_rank(phys), True)  # [T, ep]
        dest, token_idx = to_rank.t().nonzero(as_tuple=True)  # grouped by dest, then row
        send = torch.bincount(dest, minlength=self.ep_size)  # [ep]
        recv = torch.empty_like(send)
        self.group.all_to_all_single(recv, send)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        packed = _pack(hidden[token_idx], phys[token_idx], topk_weights[token_idx])
        rows = packed.new_empty((sum(recv_counts), packed.shape[1]))
        self.group.all_to_all_single(rows, packed, recv_counts, send_counts)
        x, rphys, weights = _unpack(rows, H, hidden.dtype, K)
        ids, weights = router.localize(rphys, weights)
        self._count(T, send_counts, recv_counts, packed.shape[1], 0)
        return DispatchResult(x, weights, ids, _A2AHandle(token_idx, send_counts, recv_counts, T))

    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:
        h: _A2AHandle = self._handle(handle)
        back = expert_out.new_empty((sum(h.send_counts), expert_out.shape[1]))
        self.group.all_to_all_single(back, expert_out, h.send_counts, h.recv_counts)
        out = torch.zeros(
            (h.num_tokens, expert_out.shape[1]), dtype=torch.float32, device=back.device
        )
        out.index_add_(0, h.token_idx, back.float())
        self._count(
            0, h.recv_counts, h.send_counts, 0, expert_out.shape[1] * expert_out.element_size()
        )
        return out.to(expert_out.dtype)

    def _count(self, tokens: int, sent: list[int], recv: list[int], row: int, out_row: int) -> None:
        s = self.stats
        peers_sent = sum(n for r, n in enumerate(sent) if r != self.rank)
        peers_recv = sum(n for r, n in enumerate(recv) if r != self.rank)
        if row:  # dispatch: rows plus the count exchange
            s.calls += 1
            s.tokens += tokens
            s.dispatch_sent += peers_sent * row + 8 * (self.ep_size - 1)
            s.dispatch_recv += peers_recv * row + 8 * (self.ep_size - 1)
        else:
            s.combine_sent += peers_sent * out_row
            s.combine_recv += peers_recv * out_row


# ---------------------------------------------------------------------------- DeepEP


def _require_deep_ep(name: str, group: Any) -> Any:
    if importlib.util.find_spec("deep_ep") is None:
        raise RuntimeError(
            f"all2all backend {name!r} requires the 'deep_ep' package (DeepEP), which is not "
            "installed; use 'all2all' or 'allgather_reducescatter' instead"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(f"all2all backend {name!r} requires CUDA GPUs (DeepEP is GPU-only)")
    if getattr(group, "process_group", None) is None:
        raise ValueError(f"all2all backend {name!r} needs a StatelessGroup (a ProcessGroup view)")
    import deep_ep

    return deep_ep


class DeepEPHighThroughputDispatcher(Dispatcher):
    """DeepEP normal (high-throughput) kernels over NVLink/RDMA. UNTESTED in this repo.

    Experts are DeepEP's "experts" = our physical slots (DeepEP maps expert p to rank
    ``p // S``, our layout). hidden must be bfloat16 on CUDA. DeepEP returns local slot ids
    (-1 elsewhere), turned back into logical ids here; combine sums without weights,
    since the experts applied them.
    """

    name = "deepep_high_throughput"

    def __init__(
        self, group: Any, placement: ExpertPlacement, *, hidden_size: int, **_: Any
    ) -> None:
        deep_ep = _require_deep_ep(self.name, group)
        super().__init__(group, placement)
        pg = group.process_group  # DeepEP exchanges IPC handles with dist.all_gather_object
        hidden_bytes = hidden_size * 2
        nvl = rdma = 0
        for cfg in (
            deep_ep.Buffer.get_dispatch_config(self.ep_size),
            deep_ep.Buffer.get_combine_config(self.ep_size),
        ):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, self.ep_size))
            rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, self.ep_size))
        self.buffer = deep_ep.Buffer(pg, nvl, rdma)

    def dispatch(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 logical ids
        num_tokens_across_dp: Sequence[int] | None = None,  # [ep]
    ) -> DispatchResult:
        router = self.router.to(hidden.device)
        phys = router.route(topk_ids)
        P = self.placement.num_physical_experts
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(phys, P)
        x, local_idx, weights, _, handle, _ = self.buffer.dispatch(
            hidden,
            topk_idx=phys,
            topk_weights=topk_weights.float(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        ids, weights = self._local_to_logical(local_idx, weights)
        self.stats.calls += 1
        self.stats.tokens += hidden.shape[0]
        return DispatchResult(x, weights, ids, handle)

    def _local_to_logical(self, local_idx: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        local_ids = torch.tensor(self.local_expert_ids, dtype=torch.int64, device=local_idx.device)
        valid = local_idx >= 0
        ids = torch.where(
            valid,
            local_ids[local_idx.clamp(min=0)],
            torch.full_like(local_idx, self.router.sentinel),
        )
        return ids, torch.where(valid, weights, torch.zeros_like(weights))

    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:
        out, _, _ = self.buffer.combine(expert_out, self._handle(handle))
        return out


class DeepEPLowLatencyDispatcher(Dispatcher):
    """DeepEP low-latency kernels (IBGDA, fixed-size buffers). UNTESTED in this repo.

    DeepEP returns an expert-major ``[S, max_tokens * ep, H]`` tensor with per-slot
    counts; we flatten the valid rows to ``[N, H]`` with one id per row (K' = 1, weight
    1.0), so the experts' weighting is a no-op, and ``low_latency_combine`` applies the
    real top-k weights at the origin. ``max_tokens_per_rank`` bounds T on every rank.
    """

    name = "deepep_low_latency"

    def __init__(
        self,
        group: Any,
        placement: ExpertPlacement,
        *,
        hidden_size: int,
        max_tokens_per_rank: int = 128,
        **_: Any,
    ) -> None:
        deep_ep = _require_deep_ep(self.name, group)
        super().__init__(group, placement)
        self.max_tokens = max_tokens_per_rank
        self.hidden_size = hidden_size
        P = placement.num_physical_experts
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            max_tokens_per_rank, hidden_size, self.ep_size, P
        )
        self.buffer = deep_ep.Buffer(
            group.process_group,
            0,
            rdma,
            low_latency_mode=True,
            num_qps_per_rank=placement.slots_per_rank,
        )

    def dispatch(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 logical ids
        num_tokens_across_dp: Sequence[int] | None = None,  # [ep]
    ) -> DispatchResult:
        if hidden.shape[0] > self.max_tokens:
            raise ValueError(f"{hidden.shape[0]} tokens > max_tokens_per_rank={self.max_tokens}")
        router = self.router.to(hidden.device)
        phys = router.route(topk_ids)
        P = self.placement.num_physical_experts
        recv, counts_t, handle, _, _ = self.buffer.low_latency_dispatch(
            hidden, phys, self.max_tokens, P, use_fp8=False
        )
        counts = counts_t.tolist()  # host sync: fine outside CUDA graphs
        local_ids = self.local_expert_ids
        x = torch.cat([recv[s, :n] for s, n in enumerate(counts)])
        ids = torch.tensor(
            [local_ids[s] for s, n in enumerate(counts) for _ in range(n)], device=hidden.device
        )
        ones = torch.ones((x.shape[0], 1), dtype=torch.float32, device=hidden.device)
        self.stats.calls += 1
        self.stats.tokens += hidden.shape[0]
        state = (handle, counts, recv.shape, phys, topk_weights.float())
        return DispatchResult(x, ones, ids.view(-1, 1), state)

    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:
        ll_handle, counts, shape, phys, weights = self._handle(handle)
        expert_major = expert_out.new_zeros(shape)
        start = 0
        for s, n in enumerate(counts):
            expert_major[s, :n] = expert_out[start : start + n]
            start += n
        out, _, _ = self.buffer.low_latency_combine(expert_major, phys, weights, ll_handle)
        return out


# ---------------------------------------------------------------------------- registry

DISPATCHERS: dict[str, type[Dispatcher]] = {
    cls.name: cls
    for cls in (
        AllGatherReduceScatterDispatcher,
        AllToAllDispatcher,
        DeepEPHighThroughputDispatcher,
        DeepEPLowLatencyDispatcher,
    )
}


def get_dispatcher(name: str, group: Any, placement: ExpertPlacement, **options: Any) -> Dispatcher:
    """The dispatcher for ``--all2all-backend name`` on ``group`` (a ``StatelessGroup``, or
    None for a single rank). ``options``: ``hidden_size`` (DeepEP), ``max_tokens_per_rank``
    (DeepEP low-latency); ignored by the others."""
    if name not in DISPATCHERS:
        raise ValueError(f"all2all backend must be one of {', '.join(DISPATCHERS)}; got {name!r}")
    cls = DISPATCHERS[name]
    if cls in (AllGatherReduceScatterDispatcher, AllToAllDispatcher):
        return cls(group, placement)
    return cls(group, placement, **options)
