"""Expert-parallel load balancing (EPLB): count expert load, re-place experts, move weights.

Three parts, each testable alone:

- ``ExpertLoadWindow``: per-layer, per-logical-expert token counts over the last
  ``window`` steps. Every MoE layer records into one row of a shared ``[L, E]`` tensor
  (``FusedMoE.bind_expert_load``); at the end of a step that tensor is copied into a
  ring of ``window`` such snapshots and zeroed, so recording costs one bincount per layer
  and one copy per step. A dummy step (an idle rank's filler forward) advances the ring
  with zeros: its token is not real load, but the ring must advance in lockstep with the
  other ranks' so that their windows cover the same steps.
- Pure planning: ``plan_rebalance`` (per layer: the new placement, or the old one when
  ``rebalance`` would not lower the imbalance, so noise does not cause churn) and
  ``transfer_plan`` (what one rank sends, receives and copies locally for a move list).
- ``EplbState``: the collective shell. ``end_step(is_dummy)`` runs after every forward
  on every EP rank; every ``interval`` steps it calls ``rebalance()``, which all-reduces
  the window over the EP group (global load), plans (identically on every rank: same
  integers in, same pure function), moves the weights with one ``all_to_all_single`` per
  changed layer, then installs the new expert maps and dispatcher placements.

Lockstep: a "step" is one forward of the model, real or dummy. Under EP every forward
runs collectives over the EP group, so every rank has run exactly the same number of
forwards at any step boundary; ``steps % interval == 0`` is therefore reached by all
ranks between the same two forwards and needs no extra agreement. The same holds for
the ring's slot index.

Why an all-to-all for the weights: both sides know the plan, so the split sizes need no
exchange, one collective per layer moves every expert that changes rank, and no pairwise
send/recv ordering can deadlock. Each moved expert travels as one row
(``w13[slot]`` then ``w2[slot]``, flattened, model dtype).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tidal.moe.layer import FusedMoE
from tidal.moe.placement import DISK, ExpertMove, ExpertPlacement, plan_moves, rebalance

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- load window


class ExpertLoadWindow:
    """Ring buffer of per-step ``[L, E]`` expert counts over the last ``window`` steps."""

    def __init__(
        self, num_layers: int, num_experts: int, window: int, device: torch.device | str = "cpu"
    ) -> None:
        if window < 1:
            raise ValueError(f"eplb window must be >= 1 step, got {window}")
        self.window = window
        # Written by the MoE layers during a forward (one row per layer).
        self.current = torch.zeros((num_layers, num_experts), dtype=torch.int64, device=device)
        # int32: one step's count per expert is at most tokens * top_k.
        self._ring = torch.zeros(
            (window, num_layers, num_experts), dtype=torch.int32, device=device
        )  # [W, L, E]
        self.steps = 0

    def end_step(self, record: bool = True) -> None:
        """Close the current step: keep its counts (``record``) or a zero row (dummy)."""
        slot = self._ring[self.steps % self.window]
        if record:
            slot.copy_(self.current)
        else:
            slot.zero_()
        self.current.zero_()
        self.steps += 1

    def total(self) -> Tensor:  # [L, E] int64: counts over the last min(steps, W) steps
        return self._ring.sum(dim=0, dtype=torch.int64)


# ---------------------------------------------------------------------- pure planning


def plan_rebalance(
    load: Sequence[Sequence[int]],  # [L][E] global counts per layer
    old: Sequence[ExpertPlacement],  # [L] current placement per layer
    num_redundant: int,
) -> list[ExpertPlacement]:
    """The placement each layer should have: ``rebalance(load)`` when it lowers the
    layer's imbalance (max/mean rank load), else the old one (no load, or no gain)."""
    if len(load) != len(old):
        raise ValueError(f"load has {len(load)} layers, placements {len(old)}")
    out = []
    for counts, cur in zip(load, old):
        if sum(counts) == 0:
            out.append(cur)
            continue
        new = rebalance([float(c) for c in counts], cur.ep_size, num_redundant)
        if new.slots_per_rank != cur.slots_per_rank:
            raise ValueError(
                f"rebalance gave {new.slots_per_rank} slots per rank, the layer has "
                f"{cur.slots_per_rank}: num_redundant ({num_redundant}) changed?"
            )
        better = new.imbalance(counts) < cur.imbalance(counts)
        out.append(new if better and new != cur else cur)
    return out


@dataclass(frozen=True)
class TransferPlan:
    """One rank's share of a set of expert moves (slots are local slot indices).

    ``send[d]``: old slots whose experts go to rank d, in the order d expects them.
    ``recv[s]``: new slots filled from rank s, in the order s sends them.
    ``local``: ``(old_slot, new_slot)`` copies inside this rank.
    """

    send: tuple[tuple[int, ...], ...]  # [ep]
    recv: tuple[tuple[int, ...], ...]  # [ep]
    local: tuple[tuple[int, int], ...]

    @property
    def num_sent(self) -> int:
        return sum(len(s) for s in self.send)

    @property
    def num_received(self) -> int:
        return sum(len(r) for r in self.recv)


def transfer_plan(moves: Sequence[ExpertMove], rank: int, ep_size: int) -> TransferPlan:
    """What ``rank`` does for ``moves`` (from ``plan_moves`` with one EP size). Sender and
    receiver both walk ``moves`` in its order, so the rows of each (src, dst) pair line up."""
    send: list[list[int]] = [[] for _ in range(ep_size)]
    recv: list[list[int]] = [[] for _ in range(ep_size)]
    local: list[tuple[int, int]] = []
    for m in moves:
        if m.src_rank == DISK:
            raise ValueError(f"expert {m.logical_expert} has no live copy to move from")
        if m.local or m.src_rank == m.dst_rank:
            if m.dst_rank == rank:
                local.append((m.src_slot, m.dst_slot))
            continue
        if m.src_rank == rank:
            send[m.dst_rank].append(m.src_slot)
        if m.dst_rank == rank:
            recv[m.src_rank].append(m.dst_slot)
    return TransferPlan(tuple(tuple(s) for s in send), tuple(tuple(r) for r in recv), tuple(local))


# ---------------------------------------------------------------------- weight moves


@torch.no_grad()
def move_expert_weights(moe: FusedMoE, plan: TransferPlan, group: Any) -> None:
    """Apply ``plan`` to ``moe``'s per-slot weights (``w13``/``w2`` and the FP8 scales or
    expert biases: ``FusedMoE.expert_part_names``), through ``read_weights`` and
    ``write_weights`` (ordinary parameters keep their storage, so anything holding a
    pointer to them stays valid; a packed layer is packed again). Collective over
    ``group`` when it has more than one rank: every rank calls it for the same layers in
    the same order."""
    names = moe.expert_part_names()
    # [S, 2I, H], [S, H, I], then [S, ...] scales or biases (copies): sent as bytes, one
    # row per slot, and written with the moves into these copies
    parts = list(moe.read_weights(names).values())
    sizes = [p[0].numel() * p.element_size() for p in parts]
    send_slots = [s for slots in plan.send for s in slots]
    recv_slots = [s for slots in plan.recv for s in slots]
    device = parts[0].device
    idx = torch.tensor(send_slots, dtype=torch.int64, device=device)
    # [N_send, sum(sizes)] uint8
    rows = torch.cat([p[idx].flatten(1).contiguous().view(torch.uint8) for p in parts], dim=1)
    got = rows.new_empty((len(recv_slots), rows.shape[1]))  # [N_recv, sum(sizes)]
    if group is not None and group.world_size > 1:
        group.all_to_all_single(got, rows, [len(r) for r in plan.recv], [len(s) for s in plan.send])
    elif rows.shape[0] or got.shape[0]:
        raise ValueError("a one-rank group cannot send or receive experts")
    if plan.local:  # every moved slot read before any is written: slots may swap
        old = torch.tensor([o for o, _ in plan.local], dtype=torch.int64, device=device)
        new = torch.tensor([n for _, n in plan.local], dtype=torch.int64, device=device)
        for p, moved in zip(parts, [p[old] for p in parts]):
            p[new] = moved
    if recv_slots:
        ridx = torch.tensor(recv_slots, dtype=torch.int64, device=device)
        for p, piece in zip(parts, got.split(sizes, dim=1)):
            p[ridx] = piece.contiguous().view(p.dtype).reshape(-1, *p.shape[1:])
    moe.write_weights(dict(zip(names, parts)))


# ---------------------------------------------------------------------- the shell


class EplbState:
    """Expert load tracking and (optionally) periodic rebalancing for one EP rank.

    ``layers``: the model's MoE layers; ``layer_ids``: their decoder-layer indices (the
    keys of ``get_expert_load``); ``placements``: each layer's current placement.
    ``rebalance_interval``: steps between rebalances; 0 disables them (load is still
    counted, for ``/stats``).
    """

    def __init__(
        self,
        layers: Sequence[FusedMoE],
        layer_ids: Sequence[int],
        placements: Sequence[ExpertPlacement],
        group: Any,
        *,
        window: int,
        rebalance_interval: int,
        num_redundant: int,
    ) -> None:
        if not (len(layers) == len(layer_ids) == len(placements)) or not layers:
            raise ValueError("need one layer id and one placement per MoE layer (at least one)")
        if rebalance_interval < 0:
            raise ValueError(f"eplb interval must be >= 0, got {rebalance_interval}")
        self.layers = list(layers)
        self.layer_ids = list(layer_ids)
        self.placements = list(placements)
        self.group = group
        self.rank = 0 if group is None else group.rank
        self.interval = rebalance_interval
        self.num_redundant = num_redundant
        self.num_rebalances = 0
        device = self.layers[0].expert_map.device  # not w13: a packed path would rebuild it
        self.window = ExpertLoadWindow(len(layers), layers[0].num_experts, window, device)
        for i, moe in enumerate(self.layers):
            moe.bind_expert_load(self.window.current[i])

    @property
    def steps(self) -> int:
        return self.window.steps

    def end_step(self, is_dummy: bool = False) -> bool:
        """After every forward (real or dummy), on every EP rank. Returns True when this
        step boundary rebalanced (a collective that all ranks enter together)."""
        self.window.end_step(record=not is_dummy)
        if self.interval and self.window.steps % self.interval == 0:
            self.rebalance()
            return True
        return False

    def local_load(self) -> dict[int, list[int]]:
        """Decoder-layer index -> this rank's token count per logical expert over the
        window (its own tokens' routing; the sum over ranks is the global load)."""
        total = self.window.total().tolist()
        return dict(zip(self.layer_ids, total))

    def global_load(self) -> Tensor:  # [L, E] int64, collective: the sum over EP ranks
        load = self.window.total()
        if self.group is not None and self.group.world_size > 1:
            self.group.all_reduce(load)
        return load

    def rebalance(self) -> list[bool]:
        """Collective over the EP group: re-place every layer's experts from the global
        load of the window and move the weights. Returns, per layer, whether it changed."""
        load = self.global_load().tolist()
        new = plan_rebalance(load, self.placements, self.num_redundant)
        changed = [n != o for n, o in zip(new, self.placements)]
        for moe, old, cur, ch in zip(self.layers, self.placements, new, changed):
            if ch:
                self._install(moe, old, cur)
        self.placements = new
        self.num_rebalances += 1
        logger.info(
            "EPLB step %d: %d of %d MoE layers re-placed",
            self.window.steps,
            sum(changed),
            len(changed),
        )
        return changed

    def _install(self, moe: FusedMoE, old: ExpertPlacement, new: ExpertPlacement) -> None:
        ep = old.ep_size
        move_expert_weights(moe, transfer_plan(plan_moves(old, new), self.rank, ep), self.group)
        moe.set_local_experts(new.local_expert_ids(self.rank))
        if moe.dispatcher is not None:
            moe.dispatcher.set_placement(new)
