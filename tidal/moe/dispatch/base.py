"""What every expert-parallel dispatcher is: the ``Dispatcher`` base class, its result
type, the replica router and the byte counter.

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

The backends are ``collective.py`` (gloo or NCCL collectives) and ``deepep.py``;
``tidal.moe.dispatch.get_dispatcher`` picks one by name.
"""

from __future__ import annotations

import dataclasses
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


class SoloGroup:
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


class Dispatcher(ABC):
    """Base: holds the group, the placement, the replica router and the byte counter."""

    name: ClassVar[str]

    def __init__(self, group: Any, placement: ExpertPlacement) -> None:
        if group is None:
            group = SoloGroup()
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
