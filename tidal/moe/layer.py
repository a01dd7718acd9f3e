"""FusedMoE: the MoE block of a decoder layer (router + this rank's experts).

Forward::

    router_logits = hidden @ gate.T                       # [T, E_global]
    topk_weights, topk_ids = softmax_topk(...)            # [T, K] f32, [T, K] int64
    if dispatcher: hidden, topk_weights, topk_ids, handle = dispatcher.dispatch(...)
    out = experts(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    if dispatcher: out = dispatcher.combine(out, handle)

Weights: ``w13 [E_local, 2I, H]`` (gate rows, then up rows) and ``w2 [E_local, H, I]``;
local slot i holds global expert ``local_expert_ids[i]``. ``expert_map [E_global] int32``
maps a global id to its local slot or -1. Without a dispatcher and with a subset of
experts, the output holds only the local experts' share (what a dispatcher then sums).

Expert parallelism: the EP setup (``tidal/executor/model_runner.py``) sets ``dispatcher``
and points every layer's ``forward_context`` at one shared ``MoEForwardContext``, whose
``num_tokens_across_dp`` the runner fills before each forward (the token counts all ranks
agreed on), so a dispatcher needs no count exchange of its own.

Tensor parallelism (``tp``, ``tidal/distributed/tensor_parallel.py``): without a dispatcher each
worker holds every expert's slice of the intermediate dimension (``intermediate_size`` is
that slice) and the partial outputs are summed over the TP group; with one (EP over
DP x TP workers) each worker routes and dispatches only its share of the rows
(``TensorParallel.row_shares``) and the TP group all-gathers the results.

Expert backends share one signature (see ``tidal/moe/reference.py``) and are looked up
by name in ``EXPERT_BACKENDS``; "triton" is imported lazily so CPU-only installs work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.cpu_ext import kernel_available
from tidal.kernels.cpu_moe import CpuPackedExperts
from tidal.kernels.cpu_router import CpuPackedGate, router_cpu_ok, softmax_topk_cpu
from tidal.kernels.fused_moe_torch import (
    PackedExperts,
    empty_k_major_experts,
    fused_experts_torch,
    is_k_major,
)
from tidal.kernels.onednn import onednn_available, pack_weight, packed_linear
from tidal.moe.reference import fused_experts_reference
from tidal.moe.router import softmax_topk

ExpertsFn = Callable[..., Tensor]


class MoEDispatcher(Protocol):
    """What FusedMoE calls when ``self.dispatcher`` is set (implemented in moe/dispatch/).

    ``dispatch`` moves tokens (with their routing) to the ranks owning their experts and
    returns what this rank must compute plus an opaque handle; ``combine`` returns this
    rank's expert output ``[T', H]`` to the tokens' home ranks and sums it: ``[T, H]``.
    The experts always apply the router weights (``apply_router_weight=True``).
    """

    def dispatch(
        self,
        hidden: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        num_tokens_across_dp: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Any]: ...

    def combine(self, expert_out: Tensor, handle: Any) -> Tensor: ...


@dataclass
class MoEForwardContext:
    """Per-forward facts every MoE layer of a model shares (one object, set by the runner).

    ``num_tokens_across_dp``: tokens each EP rank feeds this forward (``[ep]``, rank
    order), agreed before the forward; None lets the dispatcher exchange them itself.
    With TP each worker is an EP rank and feeds its share of its DP rank's tokens.
    """

    num_tokens_across_dp: list[int] | None = None


def _triton_experts(*args: Any, **kwargs: Any) -> Tensor:
    try:
        # Optional dependency: tidal.kernels.fused_moe imports triton at module level, and
        # triton is an extra (``tidal[triton]``); imported on first use so CPU-only
        # installs, which never pick this backend, work without it.
        from tidal.kernels.fused_moe import fused_experts
    except ImportError as e:
        raise RuntimeError(
            f"moe backend 'triton' needs triton and a working tidal.kernels.fused_moe: {e}"
        ) from e
    return fused_experts(*args, **kwargs)


EXPERT_BACKENDS: dict[str, ExpertsFn] = {
    "reference": fused_experts_reference,
    "torch": fused_experts_torch,
    "triton": _triton_experts,
}


def resolve_moe_backend(backend: str, device: str | torch.device) -> str:
    """``auto`` -> triton on CUDA, torch elsewhere; other names are checked."""
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in EXPERT_BACKENDS:
        raise ValueError(
            f"moe backend must be 'auto' or one of {sorted(EXPERT_BACKENDS)}, got {backend!r}"
        )
    return backend


def build_expert_map(
    num_experts: int, local_expert_ids: Sequence[int], device: Any = None
) -> Tensor:  # [E_global] int32, global id -> local slot or -1
    ids = list(local_expert_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"local_expert_ids has duplicates: {ids}")
    bad = [e for e in ids if not 0 <= e < num_experts]
    if bad:
        raise ValueError(f"local_expert_ids out of range [0, {num_experts}): {bad}")
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    expert_map[torch.tensor(ids, dtype=torch.int64, device=device)] = torch.arange(
        len(ids), dtype=torch.int32, device=device
    )
    return expert_map


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        local_expert_ids: Sequence[int] | None = None,
        backend: str = "torch",
        *,
        dtype: torch.dtype | None = None,
        device: Any = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.local_expert_ids = (
            list(range(num_experts)) if local_expert_ids is None else list(local_expert_ids)
        )
        self.backend = resolve_moe_backend(backend, device or "cpu")
        self.experts_fn: ExpertsFn = EXPERT_BACKENDS[self.backend]
        n_local = len(self.local_expert_ids)
        kw = {"dtype": dtype, "device": device}
        # Parameters start uninitialised: the loader (or a test) fills them.
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, **kw), requires_grad=False)
        self.w13 = nn.Parameter(
            torch.empty(n_local, 2 * intermediate_size, hidden_size, **kw), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(n_local, hidden_size, intermediate_size, **kw), requires_grad=False
        )
        self.register_buffer(
            "expert_map", build_expert_map(num_experts, self.local_expert_ids, device)
        )
        # None when the map is the identity (all experts, in order): skip the lookup.
        identity = self.local_expert_ids == list(range(num_experts))
        self._map_arg: Tensor | None = None if identity else self.expert_map
        # Expert parallelism: set by the EP setup to a MoEDispatcher; None = local only.
        self.dispatcher: MoEDispatcher | None = None
        self.forward_context: MoEForwardContext | None = None
        # EPLB: when True, forward adds each step's tokens-per-(global)expert here.
        self.record_expert_load = False
        self.register_buffer(
            "expert_load", torch.zeros(num_experts, dtype=torch.int64, device=device)
        )
        # CPU torch backend, float32: w13/w2 packed for the C++ kernel (or, when it was not
        # built, for oneDNN), derived data that every writer drops (``weights_updated``)
        # and the next forward rebuilds.
        self.use_onednn = self.backend == "torch" and torch.device(device or "cpu").type == "cpu"
        self._packed: CpuPackedExperts | PackedExperts | None = None
        # The router's gate, likewise: packed for the C++ router, or for oneDNN's linear.
        self._packed_gate: CpuPackedGate | Tensor | None = None

    def forward(self, hidden: Tensor) -> Tensor:  # [T, H] -> [T, H]
        tp = self.tp
        if tp.size == 1:
            return self._route_and_compute(hidden)
        if self.dispatcher is None:  # every expert's intermediate split: partial sums
            return tp.all_reduce(self._route_and_compute(hidden))
        sizes = tp.row_shares(hidden.shape[0])  # EP: this worker's rows only
        start = sum(sizes[: tp.rank])
        out = self._route_and_compute(hidden[start : start + sizes[tp.rank]])
        return tp.all_gather_rows(out, sizes)

    def _route_and_compute(self, hidden: Tensor) -> Tensor:  # [T, H] -> [T, H]
        if self.use_onednn and router_cpu_ok(hidden):  # the C++ router: one call
            gate = self._cpu_gate()
            topk_weights, topk_ids = softmax_topk_cpu(hidden, gate, self.top_k, self.renormalize)
        else:
            router_logits = self._router_logits(hidden)  # [T, E_global]
            topk_weights, topk_ids = softmax_topk(router_logits, self.top_k, self.renormalize)
        return self.forward_experts(hidden, topk_weights, topk_ids)

    def forward_experts(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 global ids
    ) -> Tensor:  # [T, H]
        if self.record_expert_load:
            self.expert_load += torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        kw = self._experts_kwargs()
        if self.dispatcher is None:
            return self.experts_fn(
                hidden, self.w13, self.w2, topk_weights, topk_ids, self._map_arg, True, **kw
            )
        ctx = self.forward_context
        sizes = None if ctx is None else ctx.num_tokens_across_dp
        if sizes is None:
            x, weights, ids, handle = self.dispatcher.dispatch(hidden, topk_weights, topk_ids)
        else:
            x, weights, ids, handle = self.dispatcher.dispatch(
                hidden, topk_weights, topk_ids, num_tokens_across_dp=sizes
            )
        out = self.experts_fn(x, self.w13, self.w2, weights, ids, self.expert_map, True, **kw)
        return self.dispatcher.combine(out, handle)

    def _router_logits(self, hidden: Tensor) -> Tensor:  # [T, H] -> [T, E_global]
        if self.use_onednn and hidden.dtype == torch.float32 and onednn_available():
            packed = self._packed_gate
            if not isinstance(packed, Tensor):
                packed = self._packed_gate = pack_weight(self.gate)
            return packed_linear(hidden.contiguous(), packed)
        return torch.nn.functional.linear(hidden, self.gate)

    def _experts_kwargs(self) -> dict[str, Any]:
        if not self.use_onednn or self.w13.dtype != torch.float32:
            return {}
        packed = self._packed
        if packed is None or packed.shapes != (tuple(self.w13.shape), tuple(self.w2.shape)):
            if kernel_available():  # the C++ kernel, when pip install built it
                packed = CpuPackedExperts(self.w13, self.w2)
            elif onednn_available():
                packed = PackedExperts(self.w13, self.w2)
            else:
                return {}
            self._packed = packed
        return {"packed": packed}

    def _cpu_gate(self) -> CpuPackedGate:
        gate = self._packed_gate
        if not isinstance(gate, CpuPackedGate):
            gate = self._packed_gate = CpuPackedGate(self.gate)
        return gate

    def pack_weights(self) -> None:
        """Build the packed copies now rather than at the next forward (the loader, at
        start-up). A no-op where no packed path applies."""
        self._experts_kwargs()
        if self.use_onednn and self.gate.dtype == torch.float32 and kernel_available():
            self._cpu_gate()

    def weights_updated(self) -> None:
        """``gate``/``w13``/``w2`` were written (loader, expert moves, EPLB): drop what was derived
        from them (the packed copies), rebuilt at the next forward."""
        self._packed = None
        self._packed_gate = None

    def set_local_experts(self, local_expert_ids: Sequence[int]) -> None:
        """Rebuild the expert map for new owners (EP resize / EPLB); the caller then fills
        ``w13``/``w2`` (resized here when the count changes) with those experts."""
        ids = list(local_expert_ids)
        self.weights_updated()  # the caller writes the new experts next
        self.expert_map.copy_(build_expert_map(self.num_experts, ids, self.expert_map.device))
        if len(ids) != len(self.local_expert_ids):
            k_major = is_k_major(self.w13)  # keep the storage layout the backend chose
            self.w13.data = self.w13.data.new_empty((len(ids), *self.w13.shape[1:]))
            self.w2.data = self.w2.data.new_empty((len(ids), *self.w2.shape[1:]))
            if k_major:
                self.w13.data, self.w2.data = empty_k_major_experts(self.w13, self.w2)
        self.local_expert_ids = ids
        self._map_arg = None if ids == list(range(self.num_experts)) else self.expert_map

    def bind_expert_load(self, counts: Tensor) -> None:
        """Record into ``counts [E_global] int64`` (e.g. a row of a model-wide ``[L, E]``
        tensor, so one copy per step snapshots every layer) and switch recording on."""
        if counts.shape != (self.num_experts,) or counts.dtype != torch.int64:
            raise ValueError(
                f"expert load buffer must be [{self.num_experts}] int64, got "
                f"{tuple(counts.shape)} {counts.dtype}"
            )
        self.expert_load = counts
        self.record_expert_load = True

    def reset_expert_load(self) -> Tensor:  # [E_global] int64, the counts so far
        load = self.expert_load.clone()
        self.expert_load.zero_()
        return load

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, local={len(self.local_expert_ids)}, top_k={self.top_k}, "
            f"renormalize={self.renormalize}, backend={self.backend}"
        )
