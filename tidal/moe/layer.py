"""FusedMoE: the MoE block of a decoder layer (router + this rank's experts).

Forward::

    router_logits = hidden @ gate.T                       # [T, E_global]
    topk_weights, topk_ids = route(router_logits, routing) # [T, K] f32, [T, K] int64
    if dispatcher: hidden, topk_weights, topk_ids, handle = dispatcher.dispatch(...)
    out = experts(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    if dispatcher: out = dispatcher.combine(out, handle)

Weights: ``w13 [E_local, 2I, H]`` (gate rows, then up rows) and ``w2 [E_local, H, I]``;
local slot i holds global expert ``local_expert_ids[i]``. ``expert_map [E_global] int32``
maps a global id to its local slot or -1. Without a dispatcher and with a subset of
experts, the output holds only the local experts' share (what a dispatcher then sums).

On CPU (torch backend) the router and the experts each run on the path measured at load
(``tidal/kernels/select.py``: the C++ kernels, oneDNN prepacked or torch); a packed path
holds the only copy of its weights, and ``gate``/``w13``/``w2`` are then read and
written through ``read_weights``/``write_weights`` (``HeldParamsModule``), as EPLB and
expert installs do; ``expert_weights(slots)`` rebuilds just some slots.

The routing rule (``tidal/moe/router.py``'s ``Routing``) defaults to softmax top-k; any
other rule is computed by the torch router on the gate's logits, so the C++ router, which
computes only softmax top-k, is not among the router op's candidates then (its op key
says so: ``router_logits``). ``score_bias [E_global] float32`` is the correction bias of a
rule that has one (every rank holds all of it: it is per logical expert, never moved).

Experts with biases (``expert_bias``, GPT-OSS: ``w13_bias [E_local, 2I]``, ``w2_bias
[E_local, H]``, optionally a ``ClampedSwiGLU`` activation) have two paths: on CPU the
C++ fused MoE (``native``, its variants; ``cpu_moe.ExpertExtras``) and
``tidal/moe/reference.py``'s ``biased_experts`` (``torch``, the reference), measured as
op ``biased_moe``; elsewhere only ``biased_experts`` (no onednn or triton kernel adds
biases or clamps). The biases are never packed: per slot like ``w13``/``w2``, they move
with them (EPLB's ``move_expert_weights``, ``set_local_experts``) and the kernel reads
them at each call. A router bias (``Routing.router_bias``) is ``gate_bias [E_global]``,
added to the logits; like ``score_bias`` every rank holds all of it.

FP8 experts (``hold_fp8``, a quantized checkpoint: docs/architecture.md#quantization):
``w13``/``w2`` hold ``float8_e4m3fn`` with row scales ``w13_scale``/``w2_scale``. With the
triton backend (CUDA) the Triton block-FP8 fused MoE serves (``fused_experts_fp8``: w8a8,
activations quantized per token and k-block; the reference where the k-block is not a
power of two >= 32). On CPU their path is measured like the others (op ``fp8_moe``):
``native`` is the C++ FP8 kernel (``FP8_EXPERT_KERNELS``), whose pack then holds all
four, the only copy (read and written through ``read_weights``/``write_weights``);
``torch`` is the reference: each call dequantizes the experts its tokens chose, in the
activation dtype, and runs the backend's experts on them (``fp8_reference``). Expert
moves carry the scales (``expert_part_names``, ``expert_weights``, ``expert_part_specs``).

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

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.cpu_ext import amx_fits
from tidal.kernels.cpu_fp8 import Fp8CpuExperts
from tidal.kernels.cpu_moe import ExpertExtras
from tidal.kernels.cpu_paths import PACKED_PATHS, HeldExperts, HeldGate
from tidal.kernels.fp8_torch import FP8_DTYPE, dequantize_fp8_rows, w8a8_group_ok
from tidal.kernels.fused_moe_torch import empty_k_major_experts, fused_experts_torch, is_k_major
from tidal.kernels.held_params import HeldParamsModule
from tidal.kernels.select import (
    Candidate,
    Choice,
    OpKey,
    OpSpec,
    default_choice,
    weight_candidates,
)
from tidal.kernels.triton_device import triton_serves
from tidal.moe.placement import ExpertPlacement
from tidal.moe.reference import ClampedSwiGLU, biased_experts, fused_experts_reference
from tidal.moe.router import Routing, route

ExpertsFn = Callable[..., Tensor]


class Fp8ExpertsKernel(Protocol):
    """A fused kernel of FP8 experts (e.g. the C++ one, dequantizing in registers):
    ``pack`` the held form (again after every write: load, expert moves), then the only
    copy (``unpack`` rebuilds the four tensors of ``slots``, exact), called per forward in
    place of the reference with the measured variant (``select.Candidate.variant``)."""

    def pack(
        self, w13: Tensor, w2: Tensor, w13_scale: Tensor, w2_scale: Tensor, block_k: int
    ) -> Any: ...

    def unpack(
        self, packed: Any, slots: list[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...

    def unpack_part(self, packed: Any, part: int) -> Tensor:
        """One of ``unpack``'s tensors (0: w13, 1: w2, 2: w13_scale, 3: w2_scale), all slots."""
        ...

    def __call__(
        self,
        x: Tensor,  # [T, H]
        packed: Any,
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 global ids
        expert_map: Tensor | None,  # [E_global] int32
        variant: str,
    ) -> Tensor: ...  # [T, H]


# The float32 bytes of experts the FP8 reference path dequantizes at once (at least one).
_FP8_DEQUANT_BYTES = 256 << 20
# The FP8 experts' weights, in the order of ``Fp8ExpertsKernel.unpack``.
_FP8_PARTS = ("w13", "w2", "w13_scale", "w2_scale")
# CPU path name (select.py's ``Candidate.path``) -> kernel; "torch" is the reference.
FP8_EXPERT_KERNELS: dict[str, Fp8ExpertsKernel] = {"native": Fp8CpuExperts()}

# The routings an experts trial (``FusedMoE.cpu_trial``) takes in turn, one a call (at
# least; the count is made coprime with the trial's stand-ins).
TRIAL_ROUTINGS = 8


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

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from the next forward (an EPLB step, an elastic commit)."""
        ...


@dataclass
class MoEForwardContext:
    """Per-forward facts every MoE layer of a model shares (one object, set by the runner).

    ``num_tokens_across_dp``: tokens each EP rank feeds this forward (``[ep]``, rank
    order), agreed before the forward; None lets the dispatcher exchange them itself.
    With TP each worker is an EP rank and feeds its share of its DP rank's tokens.
    """

    num_tokens_across_dp: list[int] | None = None
    # [T] bool, True on the padding rows of a decode graph (tidal/executor/graphs.py): they
    # route to an expert id no rank holds, with weight 0, so they reach no expert and add
    # nothing to the recorded load. A tensor, not a count: one graph serves any number of
    # real rows up to its size.
    padding: Tensor | None = None


def _triton_fp8_experts(*args: Any, **kwargs: Any) -> Tensor:
    from tidal.kernels.fp8_triton import fused_experts_fp8  # lazy, as _triton_experts

    return fused_experts_fp8(*args, **kwargs)


def _triton_experts(*args: Any, **kwargs: Any) -> Tensor:
    return _triton_kernels().fused_experts(*args, **kwargs)


@functools.cache
def _triton_kernels() -> Any:
    """The Triton kernel modules, imported once on first use: triton is an optional
    extra (``tidal[triton]``), so CPU-only installs, which never pick these paths, work
    without it; and importing it fixes its mode for the process."""
    try:
        from tidal.kernels import fused_moe, topk_softmax
    except ImportError as e:
        raise RuntimeError(
            f"the Triton MoE paths (moe backend 'triton', the router on CUDA) need triton "
            f"and working tidal.kernels.fused_moe / topk_softmax modules: {e}"
        ) from e
    return SimpleNamespace(
        fused_experts=fused_moe.fused_experts, topk_softmax=topk_softmax.topk_softmax
    )


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


class FusedMoE(HeldParamsModule):
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
        routing: Routing | None = None,  # None: softmax top-k (``top_k``, ``renormalize``)
        expert_bias: bool = False,  # biases on both expert projections
        activation: ClampedSwiGLU | None = None,  # None: silu(gate) * up
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.routing = routing or Routing(top_k, renormalize)
        if (self.routing.top_k, self.routing.renormalize) != (top_k, renormalize):
            raise ValueError(f"routing {self.routing} disagrees with top_k/renormalize")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.local_expert_ids = (
            list(range(num_experts)) if local_expert_ids is None else list(local_expert_ids)
        )
        self.backend = resolve_moe_backend(backend, device or "cpu")
        self.expert_bias = expert_bias
        self.activation = activation
        self.experts_fn: ExpertsFn = EXPERT_BACKENDS[self.backend]
        # The Triton router (CUDA; the rule it computes): ``route`` is its reference.
        self.triton_router = triton_serves(device or "cpu") and self.routing.softmax_of_logits
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
        self.score_bias: Tensor | None  # [E_global] float32, filled by the loader
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.register_buffer("score_bias", bias if self.routing.correction_bias else None)
        self.gate_bias: Tensor | None  # [E_global], filled by the loader
        gate_bias = torch.zeros(num_experts, **kw) if self.routing.router_bias else None
        self.register_buffer("gate_bias", gate_bias)
        # [E_local, 2I], [E_local, H]; zeros until loaded (a TP worker but the first keeps
        # w2_bias at zero: the partial outputs are summed).
        self.w13_bias: Tensor | None
        self.w2_bias: Tensor | None
        self.register_buffer(
            "w13_bias", torch.zeros(n_local, 2 * intermediate_size, **kw) if expert_bias else None
        )
        self.register_buffer(
            "w2_bias", torch.zeros(n_local, hidden_size, **kw) if expert_bias else None
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
        # CPU, torch backend: each op's path is measured at load (tidal/kernels/select.py);
        # a packed path then holds the only copy of its weights (tidal/kernels/cpu_paths.py;
        # ``w13``/``w2``/``gate`` are then read through ``read_weights``, HeldParamsModule).
        self.on_cpu = self.backend == "torch" and torch.device(device or "cpu").type == "cpu"
        self.params_dtype = self.w13.dtype
        self.expert_shape = (2 * intermediate_size, hidden_size)  # one expert's w13 (w2: .T)
        self.cpu_choice: dict[str, Choice] = {}  # "experts", "router"; absent: the default
        self._held_experts: HeldExperts | None = None
        self._held_gate: HeldGate | None = None
        # FP8 experts (``hold_fp8``): w13/w2 float8 with row scales [E_local, 2I, ceil(H/bk)]
        # and [E_local, H, ceil(I/bk)] float32 (tidal/kernels/fp8_torch.py); None: not.
        # A packed FP8 path (FP8_EXPERT_KERNELS) holds all four in its layout, the only
        # copy: w13/w2/w13_scale/w2_scale are released then (parameters for that).
        self.fp8_block_k: int | None = None
        self.w13_scale: Tensor | None = None
        self.w2_scale: Tensor | None = None
        self._fp8_held: Any = None  # the chosen FP8 kernel's pack

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
        topk_weights, topk_ids = self.route(hidden)
        ctx = self.forward_context
        if ctx is not None and ctx.padding is not None:
            return self._padded_experts(hidden, topk_weights, topk_ids, ctx.padding)
        return self.forward_experts(hidden, topk_weights, topk_ids)

    def _padded_experts(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64
        padding: Tensor,  # [T] bool
    ) -> Tensor:  # [T, H]; 0 on the padding rows
        """A graph's step (no dispatcher): padding rows get the id ``num_experts``, which
        the map extended by one -1 entry sends nowhere, and weight 0."""
        if self.dispatcher is not None:
            raise RuntimeError("padded graph steps run without expert parallelism")
        pad = padding[:, None]
        ids = topk_ids.masked_fill(pad, self.num_experts)
        weights = topk_weights.masked_fill(pad, 0.0)
        if self.record_expert_load:
            self._record_load(ids)
        # [E_global + 1] int32: the last id is on no rank
        expert_map = torch.nn.functional.pad(self.expert_map, (0, 1), value=-1)
        return self._experts(hidden, weights, ids, expert_map)

    def _record_load(self, ids: Tensor) -> None:  # [T, K] int64, ids == num_experts not counted
        # A scatter, not bincount: bincount's output size depends on the data (a host
        # sync on a GPU, none allowed in a graph); the extra bin takes the padding.
        flat = ids.reshape(-1)
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        self.expert_load += counts[: self.num_experts]

    def route(self, hidden: Tensor) -> tuple[Tensor, Tensor]:  # [T, H] -> [T, K] f32, int64
        gate = self._held("router") if self._cpu_held(hidden) else None
        if isinstance(gate, HeldGate):  # the C++ router: one call; oneDNN: its logits
            if self.routing.plain_softmax:
                variant = self._choice("router").for_rows(hidden.shape[0]).variant
                routed = gate(hidden, self.top_k, self.renormalize, variant)
                if routed is not None:  # None: this path computes only the logits
                    return routed
            logits = gate.logits(hidden)
        else:
            logits = torch.nn.functional.linear(hidden, self._weight("gate"))  # [T, E_global]
        if self.gate_bias is not None:
            logits = logits + self.gate_bias
        if self.triton_router:  # one launch for softmax, top-k and renormalisation
            return _triton_kernels().topk_softmax(logits, self.top_k, self.renormalize)
        return route(logits, self.routing, self.score_bias)

    def forward_experts(
        self,
        hidden: Tensor,  # [T, H]
        topk_weights: Tensor,  # [T, K] float32
        topk_ids: Tensor,  # [T, K] int64 global ids
    ) -> Tensor:  # [T, H]
        if self.record_expert_load:
            self._record_load(topk_ids)
        if self.dispatcher is None:
            return self._experts(hidden, topk_weights, topk_ids, self._map_arg)
        ctx = self.forward_context
        sizes = None if ctx is None else ctx.num_tokens_across_dp
        if sizes is None:
            x, weights, ids, handle = self.dispatcher.dispatch(hidden, topk_weights, topk_ids)
        else:
            x, weights, ids, handle = self.dispatcher.dispatch(
                hidden, topk_weights, topk_ids, num_tokens_across_dp=sizes
            )
        out = self._experts(x, weights, ids, self.expert_map)
        return self.dispatcher.combine(out, handle)

    def _experts(
        self, x: Tensor, weights: Tensor, ids: Tensor, expert_map: Tensor | None
    ) -> Tensor:  # [T', H]: this rank's experts on the tokens it got
        if self.fp8_block_k is not None:
            return self._fp8_experts(x, weights, ids, expert_map)
        held = self._held("experts") if self._cpu_held(x) else None
        if isinstance(held, HeldExperts):
            variant = self._choice("experts").for_rows(x.shape[0]).variant
            extras = self._extras() if self.custom_experts else None
            return held(x, weights, ids, expert_map, True, variant, extras)
        if self.custom_experts:
            w13, w2 = self._weight("w13"), self._weight("w2")
            b13, b2 = self.w13_bias, self.w2_bias
            if b13 is None or b2 is None:  # a clamped activation alone
                b13, b2 = x.new_zeros(w13.shape[:2]), x.new_zeros(w2.shape[:2])
            return biased_experts(x, w13, w2, b13, b2, weights, ids, expert_map, self.activation)
        w13, w2 = self._weight("w13"), self._weight("w2")  # released: another dtype's x
        return self.experts_fn(x, w13, w2, weights, ids, expert_map, True)

    def _extras(self) -> ExpertExtras:
        """The C++ kernel's view of this layer's biases and activation."""
        act = self.activation
        clamp = None if act is None else (act.alpha, act.limit)
        return ExpertExtras(self.w13_bias, self.w2_bias, clamp)

    # ---- FP8 experts (docs/architecture.md#quantization) -------------------------------

    def hold_fp8(self, block_k: int) -> None:
        """Hold the experts as FP8 with row scales of ``block_k``-wide column blocks, before
        the loader writes them (uninitialised). The router stays in the model's dtype."""
        if self.custom_experts:
            raise NotImplementedError("FP8 experts with biases or a clamped activation")
        n_local, (two_i, hidden) = len(self.local_expert_ids), self.expert_shape
        self.fp8_block_k = block_k
        self._held_experts = None
        self._fp8_alloc(n_local, two_i, hidden)

    def _fp8_alloc(self, n_local: int, two_i: int, hidden: int) -> None:
        assert self.fp8_block_k is not None
        bk, device = self.fp8_block_k, self.expert_map.device
        inter = two_i // 2
        kw = {"dtype": FP8_DTYPE, "device": device}
        self._fp8_held = None
        self.restore_param("w13", torch.empty((n_local, two_i, hidden), **kw))
        self.restore_param("w2", torch.empty((n_local, hidden, inter), **kw))
        self.__dict__.pop("w13_scale", None)  # plain attributes until now: parameters
        self.__dict__.pop("w2_scale", None)
        scales = (n_local, two_i, -(-hidden // bk)), (n_local, hidden, -(-inter // bk))
        self.restore_param("w13_scale", torch.empty(scales[0], device=device))
        self.restore_param("w2_scale", torch.empty(scales[1], device=device))

    def _fp8_experts(
        self, x: Tensor, weights: Tensor, ids: Tensor, expert_map: Tensor | None
    ) -> Tensor:  # [T', H]
        """FP8 experts: the Triton w8a8 kernel (triton backend), the chosen CPU kernel on
        its pack, or the reference path: dequantize, in the activation dtype, only the
        local experts these tokens chose, then the backend's experts on those."""
        assert self.fp8_block_k is not None
        if self._fp8_triton:
            assert self.w13_scale is not None and self.w2_scale is not None
            return _triton_fp8_experts(
                x, self.w13, self.w2, self.w13_scale, self.w2_scale, self.fp8_block_k,
                weights, ids, expert_map,
            )  # fmt: skip
        kernel = self._fp8_kernel()
        if kernel is not None:
            if self._fp8_held is None:
                self._pack("experts")
            variant = self._choice("experts").for_rows(x.shape[0]).variant
            return kernel(x, self._fp8_held, weights, ids, expert_map, variant)
        return self.fp8_reference(x, weights, ids, expert_map)

    def fp8_reference(
        self, x: Tensor, weights: Tensor, ids: Tensor, expert_map: Tensor | None
    ) -> Tensor:  # [T', H]
        """The reference of FP8 experts (the ``torch`` path; on a packed layer, it reads
        the experts rebuilt)."""
        assert self.fp8_block_k is not None
        w13_all, w2_all, s13, s2 = (self._weight(n) for n in _FP8_PARTS)
        n_local = w13_all.shape[0]
        if expert_map is None:  # global id == local slot
            expert_map = torch.arange(self.num_experts, dtype=torch.int32, device=ids.device)
        slots = expert_map.to(torch.int64)[ids]  # [T', K], -1: not local
        used = torch.unique(slots[slots >= 0])  # [U] local slots
        compact = torch.full((n_local,), -1, dtype=torch.int32, device=ids.device)
        compact[used] = torch.arange(used.numel(), dtype=torch.int32, device=ids.device)
        emap = expert_map.to(torch.int64)
        # [E_global] int32: global id -> its index among the dequantized experts, or -1
        used_map = torch.where(emap >= 0, compact[emap.clamp(min=0)], -1).to(torch.int32)
        bk, dt = self.fp8_block_k, x.dtype
        two_i, hidden = self.expert_shape
        # Experts dequantized a chunk at a time (a float32 copy of each on the way): a
        # prefill touching every expert of a large layer must not copy them all at once.
        # Tokens routed outside the chunk contribute zero to its call; the calls add up.
        chunk = max(1, _FP8_DEQUANT_BYTES // (3 * two_i // 2 * hidden * 4))
        out: Tensor | None = None
        for start in range(0, used.numel(), chunk):
            part = used[start : start + chunk]  # [C] local slots
            # [E_global] int32: global id -> its index in this chunk, or -1
            chunk_map = torch.where(
                (used_map >= start) & (used_map < start + part.numel()), used_map - start, -1
            ).to(torch.int32)
            w13 = dequantize_fp8_rows(w13_all[part], s13[part], bk, dt)  # [C, 2I, H]
            w2 = dequantize_fp8_rows(w2_all[part], s2[part], bk, dt)  # [C, H, I]
            y = self.experts_fn(x, w13, w2, weights, ids, chunk_map, True)
            out = y if out is None else out + y
        return out if out is not None else torch.zeros_like(x)

    @property
    def _fp8_triton(self) -> bool:
        """FP8 experts served by the Triton w8a8 kernel (triton backend, a k-block it takes)."""
        block_k = self.fp8_block_k
        return self.backend == "triton" and block_k is not None and w8a8_group_ok(block_k)

    def _fp8_kernel(self) -> Fp8ExpertsKernel | None:
        """The FP8 kernel of the chosen path (None: the reference serves)."""
        if self.fp8_block_k is None or not self.on_cpu:
            return None
        return FP8_EXPERT_KERNELS.get(self._choice("experts").layout or "")

    def _pack_fp8(self) -> None:
        """Put the FP8 experts and their scales in the chosen kernel's layout (then the
        only copy) or back in the parameters (the reference)."""
        kernel = self._fp8_kernel()
        if (kernel is None) == (self._fp8_held is None):
            return
        parts = [self._weight(n).detach() for n in _FP8_PARTS]  # parameters, or rebuilt
        if kernel is None:
            self._fp8_held = None
            for name, part in zip(_FP8_PARTS, parts):
                self.restore_param(name, part)
            return
        assert self.fp8_block_k is not None
        w13, w2, s13, s2 = parts
        held = self._fp8_held = kernel.pack(w13, w2, s13, s2, self.fp8_block_k)
        del w13, w2, s13, s2
        del parts  # the pack is the only copy from here
        for i, name in enumerate(_FP8_PARTS):
            self.release_param(name, lambda i=i: kernel.unpack_part(held, i))

    def expert_part_names(self) -> list[str]:
        """The per-slot weights an expert move carries (``read_weights``' names), in
        order: ``w13``, ``w2``, then the FP8 row scales or the expert biases where the
        model has them (each ``[E_local, ...]``)."""
        names = ["w13", "w2"]
        if self.fp8_block_k is not None:
            names += ["w13_scale", "w2_scale"]
        if self.w13_bias is not None and self.w2_bias is not None:
            names += ["w13_bias", "w2_bias"]
        return names

    def expert_part_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One expert's share of each tensor ``expert_weights`` returns: (shape, dtype),
        read without the weights (a packed path would rebuild them)."""
        two_i, hidden = self.expert_shape
        dtype = self.params_dtype
        if self.fp8_block_k is None:
            specs = [((two_i, hidden), dtype), ((hidden, two_i // 2), dtype)]
        else:
            bk = self.fp8_block_k
            specs = [
                ((two_i, hidden), FP8_DTYPE),
                ((hidden, two_i // 2), FP8_DTYPE),
                ((two_i, -(-hidden // bk)), torch.float32),
                ((hidden, -(-(two_i // 2) // bk)), torch.float32),
            ]
        if self.w13_bias is not None and self.w2_bias is not None:
            specs += [((two_i,), self.w13_bias.dtype), ((hidden,), self.w2_bias.dtype)]
        return specs

    def set_expert_weights(self, parts: Sequence[Tensor]) -> None:
        """Write every local slot: ``parts`` as ``expert_weights`` returns them, stacked
        over the slots in ``local_expert_ids`` order (an elastic install)."""
        names = self.expert_part_names()[: len(self.expert_part_specs())]
        if len(parts) != len(names):
            raise ValueError(f"expected {len(names)} expert tensors, got {len(parts)}")
        self.write_weights(dict(zip(names, parts)))

    # ---- the CPU paths (select.py) and the one copy of the weights --------------------

    def _cpu_held(self, x: Tensor) -> bool:
        """Whether a held (packed) path may serve ``x``: on CPU, of the weights' dtype (the
        candidates are float32's or bf16's; another dtype has only torch, which holds none)."""
        return self.on_cpu and x.dtype == self.params_dtype

    def _choice(self, op: str) -> Choice:
        choice = self.cpu_choice.get(op)
        if choice is None:
            choice = self.cpu_choice[op] = default_choice(self._candidates(op), True)
        return choice

    def _candidates(self, op: str) -> list[Candidate]:
        # The experts read their weights along the hidden size: AMX where it fits.
        fits = op == "experts" and amx_fits(self.params_dtype, self.expert_shape[1])
        cands = weight_candidates(self.params_dtype, amx_fits=fits)
        if op == "router" and not self.routing.plain_softmax:  # the C++ router cannot
            cands = [c for c in cands if c.path != "native"]
        if op == "experts" and self.custom_experts:  # the C++ kernel or biased_experts
            cands = [c for c in cands if c.path in ("native", "torch")]
        if op == "experts" and self.fp8_block_k is not None:
            cands = weight_candidates(FP8_DTYPE, self.params_dtype, self.fp8_block_k)
        return cands

    @property
    def custom_experts(self) -> bool:
        """Biases or a clamped activation: the C++ kernel (on CPU) or ``biased_experts``."""
        return self.expert_bias or self.activation is not None

    @property
    def experts_on_device(self) -> bool:
        """Whether the experts never read the routing on the host: the Triton kernels
        (bf16 and FP8) do not; the torch and reference experts, ``biased_experts`` and
        the FP8 reference group tokens by expert from host copies (``bincount``,
        ``unique``, ``tolist``), which a CUDA graph cannot capture
        (docs/architecture.md#cuda-graphs)."""
        if self.fp8_block_k is not None:
            return self._fp8_triton
        return self.backend == "triton" and not self.custom_experts

    def _held(self, op: str) -> HeldExperts | HeldGate | None:
        held = self._held_experts if op == "experts" else self._held_gate
        if held is None and self._choice(op).layout in PACKED_PATHS:
            self._pack(op)
            held = self._held_experts if op == "experts" else self._held_gate
        return held

    def _pack(self, op: str) -> None:
        """Put ``op``'s weights in its chosen layout: packed (then the only copy; the
        parameters are released) or the parameters themselves."""
        if op == "experts" and self.fp8_block_k is not None:
            return self._pack_fp8()
        layout = self._choice(op).layout
        want = layout if layout in PACKED_PATHS else None
        held = self._held_experts if op == "experts" else self._held_gate
        if (None if held is None else held.path) == want:
            return
        if op == "experts":
            w13, w2 = self._weight("w13").detach(), self._weight("w2").detach()  # or rebuilt
            self._held_experts = experts = None if want is None else HeldExperts(want, w13, w2)
            if experts is None:
                self.restore_param("w13", w13)
                self.restore_param("w2", w2)
            else:
                self.release_param("w13", experts.unpack_w13)
                self.release_param("w2", experts.unpack_w2)
        else:
            gate = self._weight("gate").detach()  # the parameter, or rebuilt
            self._held_gate = held_gate = None if want is None else HeldGate(want, gate)
            if held_gate is None:
                self.restore_param("gate", gate)
            else:
                self.release_param("gate", held_gate.unpack)

    def pack_weights(self) -> None:
        """Put the weights in their chosen layouts now rather than at the next forward (the
        loader, at start-up). A no-op where no CPU path applies."""
        if self.on_cpu:
            self._pack("experts")
            self._pack("router")

    def _repack(self, values: dict[str, Tensor]) -> None:
        if any(n in values for n in ("w13", "w2", "w13_scale", "w2_scale")):
            fp8 = self.fp8_block_k is not None
            self._restore_group(_FP8_PARTS if fp8 else ("w13", "w2"), values)
            self._held_experts = self._fp8_held = None
            self._pack("experts")
        if "gate" in values:
            self._restore_group(("gate",), values)
            self._held_gate = None
            self._pack("router")

    def expert_weights(self, slots: Sequence[int]) -> tuple[Tensor, ...]:
        """Copies of local ``slots``' weights, ``(w13 [n, 2I, H], w2 [n, H, I])`` plus, for
        FP8 experts, their row scales ``(w13_scale, w2_scale)`` and, for biased experts,
        ``(w13_bias [n, 2I], w2_bias [n, H])`` (``expert_part_specs``), from the layout
        that holds them, rebuilding only those slots (expert transfers)."""
        held = self._held_experts
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.expert_map.device)
        names = self.expert_part_names()[: len(self.expert_part_specs())]
        # The biases are never packed: after a pack's parts, read from themselves.
        biases = tuple(self._weight(n).index_select(0, idx) for n in names if "bias" in n)
        if held is not None:
            return (*held.unpack(list(slots)), *biases)
        kernel = self._fp8_kernel()
        if kernel is not None and self._fp8_held is not None:
            return (*kernel.unpack(self._fp8_held, list(slots)), *biases)
        return tuple(self._weight(n).index_select(0, idx) for n in names)

    def cpu_ops(self) -> dict[str, OpSpec]:
        if not self.on_cpu:
            return {}
        dtype, e_local, (two_i, hidden) = (
            self.params_dtype,
            len(self.local_expert_ids),
            self.expert_shape,
        )
        size = dtype.itemsize
        # Biased experts (GPT-OSS) are their own op: a plain layer's cached choice may have
        # picked onednn, which they lack.
        moe = "biased_moe" if self.custom_experts else "moe"
        key = OpKey(moe, (e_local, hidden, two_i // 2, self.top_k, self.num_experts))
        # Another rule's router is a different op (a cached softmax choice must not serve it).
        kind = "router" if self.routing.plain_softmax else "router_logits"
        router = OpKey(kind, (self.num_experts, hidden, self.top_k))
        ops = {
            "experts": OpSpec(
                key, tuple(self._candidates("experts")), True,
                e_local * 3 * hidden * (two_i // 2) * size,
            ),
            "router": OpSpec(
                router, tuple(self._candidates("router")), True, self.num_experts * hidden * size
            ),
        }  # fmt: skip
        if self.fp8_block_k is not None:  # the FP8 kernels' op, keyed apart
            ops["experts"] = OpSpec(
                OpKey("fp8_moe", (*key.shape, self.fp8_block_k)),
                tuple(self._candidates("experts")), True, e_local * 3 * hidden * (two_i // 2),
            )  # fmt: skip
        return ops

    def cpu_trial(self, op: str, candidate: Candidate, instances: int) -> Any:
        """Stand-ins with this layer's shape on synthetic weights; the experts' trial routes
        each token to ``top_k`` distinct local experts at random (seeded), another routing
        each call (at least ``TRIAL_ROUTINGS`` of them in turn)."""
        two_i, hidden = self.expert_shape
        stand_ins = []
        for _ in range(instances):
            # Only the op's own weights are filled and packed (the others stay untouched
            # virtual memory): the router's trial must not pay for the experts'.
            moe = FusedMoE(
                self.num_experts, self.top_k, hidden, two_i // 2, self.renormalize,
                self.local_expert_ids, routing=self.routing, expert_bias=self.expert_bias,
                activation=self.activation, dtype=self.params_dtype,
            )  # fmt: skip
            moe.set_cpu_path(op, Choice.fixed(candidate, candidate.path))
            if op == "experts" and self.fp8_block_k is not None:
                moe.hold_fp8(self.fp8_block_k)
                moe.w13.data.view(torch.uint8).fill_(0x38)  # 1.0 in e4m3
                moe.w2.data.view(torch.uint8).fill_(0x38)
                assert moe.w13_scale is not None and moe.w2_scale is not None
                moe.w13_scale.data.fill_(0.01)
                moe.w2_scale.data.fill_(0.01)
            elif op == "router":
                moe.gate.data.fill_(0.01)
                if moe.gate_bias is not None:
                    moe.gate_bias.fill_(0.01)
            else:
                moe.w13.data, moe.w2.data = empty_k_major_experts(moe.w13, moe.w2)
                moe.w13.data.fill_(0.01)
                moe.w2.data.fill_(0.01)
                if moe.w13_bias is not None and moe.w2_bias is not None:
                    moe.w13_bias.fill_(0.01)
                    moe.w2_bias.fill_(0.01)
            moe._pack(op)
            stand_ins.append(moe)
        turn = itertools.cycle(stand_ins)
        local = torch.tensor(self.local_expert_ids, dtype=torch.int64)
        top_k = min(self.top_k, len(local))

        def for_rows(rows: int) -> Any:
            x = torch.full((rows, hidden), 0.5, dtype=self.params_dtype)
            if op == "router":
                return lambda: next(turn).route(x)
            g = torch.Generator().manual_seed(rows)
            # A new routing each call, as serving's tokens have: a fixed one would read the
            # same few experts call after call (a 1-row decode: top_k of them), which stay
            # in cache and time the kernels' arithmetic rather than their reading. Their
            # count is the first from TRIAL_ROUTINGS coprime with the stand-ins', so each
            # stand-in meets every routing in turn (with a common factor some never would).
            count = next(n for n in itertools.count(TRIAL_ROUTINGS) if math.gcd(n, instances) == 1)
            routes = []
            for _ in range(count):
                pick = [torch.randperm(len(local), generator=g)[:top_k] for _ in range(rows)]
                routes.append(local[torch.stack(pick)])  # [rows, K] global ids of local experts
            route = itertools.cycle(routes)
            weights = torch.full((rows, top_k), 1.0 / top_k)
            return lambda: next(turn).forward_experts(x, weights, next(route))

        return for_rows

    def set_cpu_path(self, op: str, choice: Choice) -> None:
        self.cpu_choice[op] = choice
        if op == "experts" and self._fp8_held is not None:
            self._pack_fp8()  # loaded already: to the new layout
            return
        held = self._held_experts if op == "experts" else self._held_gate
        if held is not None and held.path != choice.layout:
            self._pack(op)  # loaded already: move the weights to the new layout

    def set_local_experts(self, local_expert_ids: Sequence[int]) -> None:
        """Rebuild the expert map for new owners (EP resize / EPLB); the caller then fills
        ``w13``/``w2`` (resized here when the count changes) with those experts."""
        ids = list(local_expert_ids)
        device = self.expert_map.device
        self.expert_map.copy_(build_expert_map(self.num_experts, ids, device))
        if len(ids) != len(self.local_expert_ids) and self.fp8_block_k is not None:
            self._fp8_alloc(len(ids), *self.expert_shape)
        elif len(ids) != len(self.local_expert_ids):
            # Fresh parameters of the new count, in the storage layout the backend chose
            # (rebuilt ones are K-major); the next forward packs them for a packed path.
            k_major = self.is_released("w13") or is_k_major(self.w13)
            (two_i, hidden), kw = self.expert_shape, {"dtype": self.params_dtype, "device": device}
            w13 = torch.empty((len(ids), two_i, hidden), **kw)
            w2 = torch.empty((len(ids), hidden, two_i // 2), **kw)
            if k_major:
                w13, w2 = empty_k_major_experts(w13, w2)
            self._held_experts = None
            self.restore_param("w13", w13)
            self.restore_param("w2", w2)
            if self.w13_bias is not None and self.w2_bias is not None:
                self.w13_bias = self.w13_bias.new_zeros((len(ids), two_i))
                self.w2_bias = self.w2_bias.new_zeros((len(ids), hidden))
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
            f"routing={self.routing}, backend={self.backend}"
        )
