"""``deepep_high_throughput`` / ``deepep_low_latency``: DeepEP buffers (CUDA only).

Written from DeepEP's documented ``Buffer`` API and **untested here** (no GPU in CI).
``deep_ep`` is an optional dependency: it is imported when one of these dispatchers is
built, after a clear error if it is missing or there is no GPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tidal.moe.dispatch.base import Dispatcher, DispatchResult
from tidal.moe.placement import ExpertPlacement


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
    # Optional dependency (not in any extra): imported here, once the checks above passed,
    # so the other backends and CPU-only installs never need it.
    import deep_ep  # pyright: ignore[reportMissingImports]

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
