"""Dispatchers built on plain collectives of a ``StatelessGroup`` (gloo on CPU, NCCL on GPU).

- ``allgather_reducescatter``: all-gather every rank's tokens (padded to the max count),
  compute the local share of all of them, reduce-scatter (sum) back. Traffic per rank
  ~ (ep-1) * max_tokens * (row bytes) each way; simple and fine for small decode batches.
- ``all2all``: a token goes only to the ranks that own one of its chosen copies, once per
  rank (all its k slots for that rank ride together); counts are exchanged first, then
  one ``all_to_all_single`` each way. Traffic ~ tokens * distinct-ranks * row bytes.

Row packing: hidden, physical ids (int32) and weights (float32) travel as one uint8 row
(``H * elem + 8K`` bytes) so each direction costs one collective, not three.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tidal.moe.dispatch.base import Dispatcher, DispatchResult


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
