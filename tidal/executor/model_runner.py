"""Batch -> tensors -> forward -> sample, for one rank.

The runner turns a ``SchedulerOutput`` into flattened inputs (no padding: prefills and
decodes share one batch), runs the model, and samples one token for every request whose
chunk reached its last known token. It owns the KV cache tensors and the persistent
batch (``input_batch.py``: block table rows and sampling metadata kept across steps,
derived from the requests, docs/architecture.md#persistent-batch); the scheduler owns
progress, and seeded sampling keeps no state (its noise is a function of the seed and
the output position, ``tidal.layers.sampler``).

Expert parallelism (``enable_expert_parallel``, EP size = DP size): the worker hands the
runner its process groups (``set_process_groups``) before ``load_model``, which then
builds the ``ExpertPlacement`` (the topology's layout, else the linear launch one), loads
only this rank's experts (non-MoE weights are replicated), and gives every ``FusedMoE``
its dispatcher and the shared ``MoEForwardContext`` (``setup_expert_parallel``, again
after an elastic resize: tidal/executor/elastic.py). Before every forward, real or dummy, the ranks all-gather their
token counts over the DP group (one CPU int64 per rank) into that context: the
dispatchers need them, and an idle rank's dummy forward enters the very same collectives,
layer by layer, as a busy rank's real one. After every forward ``EplbState.end_step``
counts the expert load and, every ``eplb_interval`` forwards with ``enable_eplb``,
rebalances; forward counts are equal on all EP ranks, so they rebalance together.

Tensor parallelism (``tp``, docs/architecture.md#tensor-parallel): every worker of a rank runs this same runner
on the same batch, each with its shard of the model (``tidal/distributed/tensor_parallel.py``); they
meet in the model's TP collectives, the logits gather included, so each also calls
``compute_logits`` wherever the driver does. Only the driver (TP rank 0) samples and
fills the output; the others' output stays empty. With EP each worker is an EP rank
that feeds its share of its DP rank's tokens, so the agreed per-DP-rank counts are
expanded into per-worker shares before the forward.

Fault isolation: a request whose host-side preparation or sampling raises (a value the
engine's validation missed) must fail alone, never the rank. Both stages are tried for
the whole batch first (no per-request cost when nothing is wrong); on an exception they
are redone request by request, and the requests that still raise are reported in
``ModelRunnerOutput.failed`` and left out of the step. The forward itself is never
retried: under EP it is a sequence of collectives, and a rank must enter each exactly
once. So a step whose every request failed preparation still runs one (dummy) forward,
and the step count every EP rank agrees on is unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import psutil
import torch

from tidal.config import EngineConfig
from tidal.distributed.tensor_parallel import TensorParallel
from tidal.executor.batch import (
    NULL_BLOCK_ID,
    ModelRunnerOutput,
    PendingRunnerOutput,
    ReadyRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tidal.executor.graphs import (
    GRAPH_BACKENDS,
    DecodeGraphs,
    DecodeStep,
    GraphDecision,
    GraphMiss,
    graph_pool_estimate,
    graphs_off,
    resolve_backend,
)
from tidal.executor.input_batch import InputBatch, Inputs
from tidal.executor.kv_budget import DeviceMemory, HostMemory, kv_cache_budget
from tidal.executor.rpc import Reduce, rpc
from tidal.kernels.host_memory import empty_huge
from tidal.layers.attention import AttentionMetadata
from tidal.layers.sampler import Sampler, compute_logprobs
from tidal.models.common import MoECausalLM
from tidal.models.cpu_decode import Verify
from tidal.models.loader import load_model
from tidal.models.registry import get_model_class
from tidal.moe.dispatch import get_dispatcher
from tidal.moe.eplb import EplbState
from tidal.moe.layer import MoEForwardContext
from tidal.moe.placement import ExpertPlacement
from tidal.protocol.messages import Logprobs
from tidal.protocol.worker import ReplyMode

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ModelRunner:
    def __init__(
        self, config: EngineConfig, device: torch.device, tp: TensorParallel | None = None
    ) -> None:
        self.config = config
        self.device = device
        # This worker's place in its rank's TP group; the worker sets it (with the group)
        # before load_model.
        self.tp = tp or TensorParallel()
        self.block_size = config.cache.block_size
        self.vocab_size = int(config.model.hf_config.vocab_size)
        self._model: MoECausalLM | None = None  # set by load_model
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        # Request state across steps: inputs and sampling metadata by array operations.
        self.input_batch = InputBatch(
            self.block_size, self.vocab_size, device, max_rows=config.scheduler.max_num_seqs
        )
        # Expert parallelism (None without EP): set by set_process_groups / load_model.
        self.dp_group: Any = None
        self.ep_group: Any = None
        # The placement every layer was set up with (launch, or the last elastic resize).
        self.placement: ExpertPlacement | None = None
        self.eplb: EplbState | None = None
        self.moe_context = MoEForwardContext()
        # What load_model loaded, so a sleep at level 2 can load it again.
        self._local_expert_ids: list[int] | None = None
        self._sleep_layout: list[list[int]] | None = None
        # Async scheduling: the last launched step's sampled ids ([N] int64, where they
        # were sampled) and each sampling request's index in them: the next step's
        # placeholder input ids.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self.graphs = self._make_graphs()
        self._graphs_tp_group: Any = None  # the TP group the graphs' collectives were captured on

    def _make_graphs(self) -> DecodeGraphs:
        """Decode graphs (docs/architecture.md#cuda-graphs); captured with the KV cache."""
        cfg = self.config
        name = resolve_backend(cfg.graph_backend, self.device)
        backend = None if name is None else GRAPH_BACKENDS[name]()
        max_blocks = -(-cfg.scheduler.max_model_len // self.block_size)
        return DecodeGraphs(
            backend, cfg.scheduler.max_num_seqs, max_blocks, self.block_size, self.device
        )

    # ---- setup -------------------------------------------------------------------------

    def set_process_groups(self, dp_group: Any, ep_group: Any) -> None:
        """Before ``load_model``: ``ep_group`` (a StatelessGroup, or None) turns EP on;
        ``dp_group`` (gloo, one member per DP rank) carries the per-forward token-count
        agreement. The EP group has one member per worker: DP size x TP size (without a
        DP group, one DP rank: its TP workers)."""
        tp = self.tp.size
        dp_size = 1 if dp_group is None else dp_group.world_size
        if ep_group is not None and dp_group is None and tp == 1:
            raise ValueError("expert parallelism needs the DP group for token-count agreement")
        if ep_group is not None and ep_group.world_size != dp_size * tp:
            raise ValueError(
                f"EP group has {ep_group.world_size} ranks, DP group {dp_size} x TP {tp}"
            )
        self.dp_group, self.ep_group = dp_group, ep_group

    @property
    def model(self) -> MoECausalLM:
        """The loaded model (``load_model`` first)."""
        if self._model is None:
            raise RuntimeError("the model runner has no model yet: load_model first")
        return self._model

    @model.setter
    def model(self, model: MoECausalLM) -> None:
        # Every call but a step reaches this runner inside the plans' ``changing``
        # (``Worker.serve``): a whole-model plan need not be checked before every step.
        model.decode_plans.verify = Verify.ON_CHANGE
        self._model = model

    @property
    def has_model(self) -> bool:
        """False before ``load_model`` and between ``free_weights`` and ``reload_weights``."""
        return self._model is not None

    def load_model(
        self,
        local_expert_ids: list[int] | None = None,
        *,
        layout: list[list[int]] | None = None,
        load_experts: bool = True,
    ) -> None:
        """Build the model and load its weights. With EP the placement decides the local
        experts: ``layout`` (the topology's, one row of logical experts per rank) when
        given, else the linear launch placement. ``load_experts=False``: allocate the
        expert slots but do not read them (a joining engine: they arrive from peers)."""
        common = {"load_experts": load_experts, "tp": self.tp, "device": self.device}
        self._local_expert_ids = local_expert_ids  # what reload_weights loads again
        if self.ep_group is None:
            self.model = load_model(self.config, local_expert_ids=local_expert_ids, **common)
            return
        if local_expert_ids is not None:
            raise ValueError("with expert parallelism the placement chooses the local experts")
        ep_size = self.ep_group.world_size
        if layout is not None:
            if len(layout) != ep_size:
                raise ValueError(f"placement has {len(layout)} rows for an EP group of {ep_size}")
            self.placement = ExpertPlacement.from_layout(num_experts(self.config), layout)
        else:
            self.placement = initial_placement(self.config, ep_size)
        rank = self.ep_group.rank
        self.model = load_model(
            self.config, local_expert_ids=self.placement.local_expert_ids(rank), **common
        )
        self.setup_expert_parallel(self.placement)

    def free_weights(self) -> None:
        """Sleep level 2 (docs/operations.md#sleep-mode): drop the model -- every weight,
        the packed layouts included, held by nothing else -- and the EP state built on it;
        ``reload_weights`` reads them again. Free the KV cache first."""
        if self._model is None:
            raise RuntimeError("no model to free: load_model first")
        if self.eplb is not None:
            # Reloaded under one placement for every layer (EPLB may have re-placed each
            # on its own): the outputs do not depend on it, and EPLB rebalances again.
            p = self.eplb.placements[0]
            self._sleep_layout = [p.local_expert_ids(r) for r in range(p.ep_size)]
        self.eplb = None
        self._model = None

    def reload_weights(self) -> None:
        """Load the model again from the checkpoint after ``free_weights`` (the loader,
        the CPU paths chosen and the weights packed as at start); then the KV cache."""
        if self._model is not None:
            raise RuntimeError("the model is loaded: free_weights first")
        self.load_model(self._local_expert_ids, layout=self._sleep_layout)

    def setup_expert_parallel(self, placement: ExpertPlacement) -> None:
        """Give every MoE layer a dispatcher for ``placement`` on the current EP group and
        start a fresh ``EplbState`` (every layer at ``placement``). The layers must already
        hold this rank's experts of ``placement``. Also after an elastic resize."""
        p = self.config.parallel
        layers = self.model.moe_layers()
        if not layers:
            raise ValueError("expert parallelism needs a model with MoE layers")
        hidden = self.model.spec.hidden_size

        def make() -> Any:
            return get_dispatcher(p.all2all_backend, self.ep_group, placement, hidden_size=hidden)

        # EPLB re-places each layer on its own, so each needs its own dispatcher; otherwise
        # one is enough (DeepEP buffers are large).
        shared = None if p.enable_eplb else make()
        for moe in layers:
            moe.dispatcher = shared or make()
            moe.forward_context = self.moe_context
        layer_ids = self.model.moe_layer_ids()
        self.eplb = EplbState(
            layers,
            layer_ids,
            [placement] * len(layers),
            self.ep_group,
            window=p.eplb_window,
            rebalance_interval=p.eplb_interval if p.enable_eplb else 0,
            num_redundant=p.num_redundant_experts,
        )

    def kv_bytes_per_block(self) -> int:
        """Cache bytes of one block over every layer, as the model's cache spec declares
        (K and V per head, or MLA's latent: docs/architecture.md#kv-cache-layouts)."""
        spec = self.model.kv_cache_spec()
        return spec.bytes_per_block(self.config.kv_cache_torch_dtype, self.block_size)

    @rpc(Reduce.FIRST)  # every TP worker caches the same amount per token
    def kv_cache_info(self) -> dict[str, Any]:
        """This worker's cache per token (``/stats``): its layout and bytes over every layer."""
        spec = self.model.kv_cache_spec()
        windows = spec.group_windows
        info = {
            "layout": spec.layout.value,
            "num_layers": spec.num_layers,
            "values_per_token_per_layer": spec.values_per_token(),
            "dtype": str(self.config.kv_cache_torch_dtype).removeprefix("torch."),
            "bytes_per_token": spec.bytes_per_token(self.config.kv_cache_torch_dtype),
            # One group: the blocks behind its window are freed (None: kept).
            "sliding_window": windows[0] if len(windows) == 1 else None,
        }
        if len(windows) > 1:  # KV cache groups: each one's window and layers
            layers = spec.layer_groups()
            info["kv_groups"] = [
                {"sliding_window": w, "num_layers": layers.count(g)} for g, w in enumerate(windows)
            ]
        return info

    @rpc(Reduce.MIN, local=True)  # what every worker's device holds
    def determine_num_blocks(self) -> int:
        """Blocks that fit the configured KV budget, capped at what max_num_seqs full-length
        sequences could ever use (no point allocating more)."""
        cache, sched = self.config.cache, self.config.scheduler
        # A sequence's table has an entry per block per KV cache group; a sliding group
        # holds only its window's (KVCacheSpec.peak_blocks).
        spec = self.model.kv_cache_spec()
        step = sched.max_num_batched_tokens
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        else:
            graphs = self._graph_pool_estimate()  # before measuring: it frees what it took
            device = self._device_memory(graphs)
            budget = kv_cache_budget(cache, host=self._host_memory(), device=device, env=os.environ)
            per_seq = spec.peak_blocks(sched.max_model_len, self.block_size, step)
            num_blocks = min(
                budget.bytes // self.kv_bytes_per_block(), sched.max_num_seqs * per_seq + 1
            )
            logger.info(
                "KV budget %d MiB per worker (from %s; %d MiB kept for the decode graphs): "
                "%d blocks",
                budget.bytes >> 20, budget.source, graphs >> 20, num_blocks,
            )  # fmt: skip
        # What the scheduler admits against (Scheduler._validate): the blocks it hands out
        # (all but the null block 0) must hold the KV of a full-length sequence, which is
        # every token but the last. Else the engine would refuse the long requests that
        # the frontend, checking max_model_len, lets through.
        # With KV cache groups, each group's peak counts (the scheduler's bound too).
        usable, need = num_blocks - 1, sched.max_model_len - 1
        if usable < spec.peak_blocks(need, self.block_size, step):
            raise ValueError(
                f"KV cache of {num_blocks} blocks x {self.block_size} tokens (one block "
                f"reserved, {spec.num_groups} KV cache group(s)) cannot hold one sequence of "
                f"max_model_len={sched.max_model_len}; "
                "lower max_model_len or raise kv_cache_memory_bytes / num_gpu_blocks_override"
            )
        return num_blocks

    def _host_memory(self) -> HostMemory:
        par = self.config.parallel
        workers = max(1, par.data_parallel_size_local) * par.tensor_parallel_size
        return HostMemory(available=psutil.virtual_memory().available, workers=workers)

    def _device_memory(self, graphs: int = 0) -> DeviceMemory | None:
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(total=total, used=total - free, graphs=graphs)

    @torch.inference_mode()
    def _graph_pool_estimate(self) -> int:
        """CUDA with graphs on: the bytes their pool will hold (docs/architecture.md#cuda-graphs),
        from one eager run of the largest size's step on a one-block cache; 0 elsewhere (a
        CPU step has no graph pool; the emulating backend holds no memory of its own).
        Its cached blocks are given back, so the device's free memory excludes them."""
        if self.device.type != "cuda" or self._graphs_off() is not None:
            return 0
        group = self.tp.group
        # This call runs no collective (its RPC is local): each TP worker measures its
        # step alone, its all-reduces the identity (they work in place: the same bytes).
        self.tp.group = None if group is None else _AloneGroup(group)
        try:
            groups = self.model.kv_cache_spec().num_groups
            peak = self.on_null_block(
                lambda: self.graphs.measure_step(self._padded_forward, groups)
            )
        except Exception as e:  # noqa: BLE001 - as before: nothing held back, capture may fail
            logger.warning("measuring the decode graphs' step failed (%s): none held back", e)
            return 0
        finally:
            self.tp.group = group
            torch.cuda.empty_cache()
        row_bytes = self.model.spec.hidden_size * self.config.model.torch_dtype.itemsize
        estimate = graph_pool_estimate(peak, self.graphs.sizes, row_bytes)
        self.graphs.pool_estimate = estimate
        return estimate

    @rpc(Reduce.SUM, local=True)  # a rank's cache is its workers' together
    def kv_cache_bytes(self, num_blocks: int) -> int:
        """Bytes ``num_blocks`` take in this worker's cache."""
        return num_blocks * self.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        spec = self.model.kv_cache_spec()
        # --kv-cache-dtype (the model's by default): every layer's cache, also when an
        # elastic resize or a wake-up rebuilds it; the layers cast new K/V into it.
        dtype = self.config.kv_cache_torch_dtype
        shape = spec.layer_shape(num_blocks, self.block_size)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s layout, %s, %d bytes per token (%d layers)",
            num_blocks, self.block_size, spec.layout.value, dtype, spec.bytes_per_token(dtype),
            spec.num_layers,
        )  # fmt: skip
        if spec.num_groups > 1:
            logger.info(
                "KV cache groups (sliding windows, None = full attention): %s over %d "
                "tensors; each request has a block table per group",
                list(spec.group_windows), spec.num_pages,
            )  # fmt: skip
        # One tensor per page: the i-th layer of every KV cache group shares tensor i.
        self.kv_caches = [self._zeros_cache(shape, dtype) for _ in range(spec.num_pages)]
        self._bind_caches()
        self.input_batch.num_kv_groups = spec.num_groups
        self.capture_graphs()

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode graphs on the bound cache (again after every rebuild of it:
        a graph reads the cache at fixed addresses)."""
        off = self._graphs_off()
        self._graphs_tp_group = self.tp.group
        self.graphs.capture(
            self._padded_forward, lambda: list(self.kv_caches), off,
            self.model.kv_cache_spec().num_groups,
        )  # fmt: skip
        if self.tp.size > 1 and self.graphs.enabled:
            self.graphs.agree_failed(self.tp.all_reduce)

    def on_null_block(self, fn: Callable[[], T]) -> T:
        """``fn()`` with a cache of the null block alone bound to every layer (a step of
        padding rows before the cache is sized), then the cache bound before again."""
        spec = self.model.kv_cache_spec()
        shape = spec.layer_shape(1, self.block_size)
        dtype = self.config.kv_cache_torch_dtype
        self.model.bind_kv_cache(
            [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        )
        try:
            return fn()
        finally:
            self._bind_caches()

    def _bind_caches(self) -> None:
        """Give every layer its page of the KV cache: with KV cache groups the i-th layer
        of each group shares tensor i (``layer_pages``); no cache yet, empty ones."""
        spec = self.model.kv_cache_spec()
        if not self.kv_caches:
            self.model.bind_kv_cache([torch.empty(0)] * spec.num_layers)
        else:
            self.model.bind_kv_cache([self.kv_caches[i] for i in spec.layer_pages()])

    def _graphs_off(self) -> GraphMiss | None:
        """Why this engine replays no graph (``graphs_off``), or None; gives the MoE
        layers the forward context the padding mask reaches them through."""
        layers = self.model.moe_layers()
        for moe in layers:
            moe.forward_context = self.moe_context
        backend = self.graphs.backend
        return graphs_off(
            enforce_eager=self.config.enforce_eager,
            backend=None if backend is None else backend.name,
            expert_parallel=self.ep_group is not None,
            tensor_parallel=None if self.tp.size == 1 else self.tp.group.backend_name,
            experts_on_device=all(m.experts_on_device for m in layers),
        )

    def _padded_forward(
        self,
        input_ids: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64
        attn: AttentionMetadata,
        padding: torch.Tensor,  # [B] bool
    ) -> torch.Tensor:  # [B, H]
        self.moe_context.padding = padding
        try:
            return self.model(input_ids, positions, attn)
        finally:
            self.moe_context.padding = None

    def free_kv_cache(self) -> int:
        """Unbind and drop the cache tensors (the last references: on CPU each is its own
        mapping, unmapped with it); the bytes they held."""
        freed = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self.graphs.release()  # they read the cache being freed
        self.kv_caches = []
        self._bind_caches()  # empty ones: nothing steps while asleep
        return freed

    def _zeros_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        # Decode attention reads each sequence's blocks scattered over the whole cache: on
        # huge pages that costs no TLB miss per block. Touched now, as torch.zeros would,
        # so no step pays the page faults.
        return empty_huge(shape, dtype).zero_()

    # ---- step --------------------------------------------------------------------------

    # Only the driver (TP rank 0) samples; a SchedulerOutput crosses to worker processes
    # in its delta form (tidal/executor/step_wire.py).
    @rpc(Reduce.FIRST, reply=ReplyMode.DRIVER)
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out, sampled = self._execute(sched)
        if sampled is not None:
            rids, tokens = sampled
            for rid, tok in zip(rids, tokens.tolist()):  # the step's one host sync
                out.sampled_token_ids[rid] = [tok]
        return out

    # In-process only (async scheduling needs tensor_parallel_size 1): the reply holds
    # tensors.
    @rpc(Reduce.FIRST, reply=ReplyMode.DRIVER)
    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> PendingRunnerOutput:
        """``execute_model`` without waiting (docs/architecture.md#async-scheduling): the
        sampled ids stay on the device, their host copy is queued behind the step, and
        ``resolve`` waits for it. Placeholder input ids come from the previous call's
        sampled ids."""
        out, sampled = self._execute(sched)
        self._last_sampled = None
        if sampled is None:
            return ReadyRunnerOutput(out)
        rids, tokens = sampled
        self._last_sampled = (tokens, {rid: i for i, rid in enumerate(rids)})
        return _SampledOnDevice(out, rids, tokens)

    def _execute(
        self, sched: SchedulerOutput
    ) -> tuple[ModelRunnerOutput, tuple[list[str], torch.Tensor] | None]:
        """One step; the sampled ids ([N] int64, on the device) left to the caller."""
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out, None
        decode = self._graph_step(sched)
        if decode is not None:
            step, size = decode
            # Placeholders (async scheduling) read the previous step's ids on the device.
            hidden = self.graphs.replay(step, size, self._last_sampled)[: step.num]  # [n, H]
            rows: DecodeStep | Inputs = step
        else:
            inputs = self._prepare_inputs_isolated(sched, out.failed)
            if inputs is None:
                # Every request failed: EP peers still expect this rank in the forward's
                # collectives (and in the same forward count for EPLB).
                if self.ep_group is not None:
                    self.execute_dummy_batch()
                return out, None
            if inputs.placeholders:
                self._fill_placeholders(inputs)
            hidden = self._forward(inputs.input_ids, inputs.positions, inputs.attn)  # [T, H]
            rows = inputs
        sampled = None
        if rows.sample_reqs:
            sampled = self._sample(
                hidden, rows.sample_rows, rows.sample_reqs, out, sched.grammar_bitmask
            )
        if rows.prompt_lp:
            self._prompt_logprobs(hidden, rows.prompt_lp, out)
        self._end_step(is_dummy=False)
        return out, sampled

    def _fill_placeholders(self, inputs: Inputs) -> None:
        """Write the previous step's sampled ids into the placeholder input ids, on the
        device. A request missing there failed in that step: its placeholder stays 0 and
        its output of this step is dropped with it."""
        last = self._last_sampled
        if last is None:
            return
        tokens, index = last
        rows = [row for row, rid in inputs.placeholders if rid in index]
        src = [index[rid] for _, rid in inputs.placeholders if rid in index]
        if not rows:
            return
        ids = inputs.input_ids  # [T] int64
        if ids.device.type == "cpu":  # the host is the device: numpy, no torch op each
            fill_placeholders_host(ids, tokens, rows, src)
        else:
            fill_placeholders_device(ids, tokens, rows, src)

    def _graph_step(self, sched: SchedulerOutput) -> tuple[DecodeStep, int] | None:
        """The step's arrays and padded size when a graph replays it, else None (eager);
        counts the decision (``graph_stats``)."""
        if self.tp.group is not self._graphs_tp_group and self.graphs.captured:
            # The TP group was rebuilt (a peer rank's death cut a step short): the graphs
            # hold the old one's NCCL communicator. Every TP worker rebuilt it before this
            # same step, so they capture again together (the warm-ups' collectives match).
            self.capture_graphs()
        # The per-request count only picks a size: an engine with graphs off (every CPU
        # engine by default) skips it on every step.
        num_decodes = 0
        if self.graphs.off is None:
            num_decodes = sum(1 for sr in sched.scheduled if sr.num_new_tokens == 1)
        decision = self.graphs.decide(num_decodes, len(sched.scheduled) - num_decodes)
        step = None
        if decision.size is not None:
            try:
                step = self.input_batch.prepare_decode(sched)
            except Exception as e:  # noqa: BLE001 - the eager path finds the culprit(s)
                logger.warning("preparing a decode graph's inputs failed (%s): eager step", e)
                decision = GraphDecision(None, GraphMiss.PREPARE_FAILED)
        self.graphs.stats.record(decision, num_decodes)
        return None if step is None or decision.size is None else (step, decision.size)

    @rpc(Reduce.FIRST, reply=ReplyMode.DRIVER, local=True)
    def graph_stats(self) -> dict[str, Any]:
        """Decode graphs (``/stats`` ``cuda_graphs``): backend, sizes captured and failed,
        capture seconds, steps replayed and eager steps by reason."""
        return self.graphs.to_dict()

    @rpc(reply=ReplyMode.DRIVER)
    @torch.inference_mode()
    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        """A forward over dummy tokens that writes no KV: keeps collectives of idle ranks
        matched with busy ones (data parallel + expert parallel)."""
        # Dummy KV goes to the reserved null block, which no request ever reads.
        blocks = [NULL_BLOCK_ID] * -(-num_tokens // self.block_size)
        attn = AttentionMetadata.build([(0, num_tokens, blocks)], self.block_size, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, dtype=torch.long, device=self.device)
        self._forward(ids, pos, attn)
        self._end_step(is_dummy=True)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [T] int64, [T] int64 -> [T, H]
        if self.ep_group is not None:
            counts = self.agree_num_tokens(input_ids.shape[0])  # per DP rank
            if self.tp.size > 1:  # per worker: each feeds its share of its rank's tokens
                counts = [c for n in counts for c in self.tp.row_shares(n)]
            self.moe_context.num_tokens_across_dp = counts
        return self.model(input_ids, positions, attn)

    def agree_num_tokens(self, num_tokens: int) -> list[int]:
        """Every rank's token count for this forward, in rank order (a DP-group all-gather:
        all ranks call it before the same forward)."""
        if self.dp_group is None:  # one DP rank (EP over its TP workers only)
            return [num_tokens]
        mine = torch.tensor([num_tokens], dtype=torch.int64)  # [1] CPU: gloo
        return [int(n) for n in self.dp_group.all_gather(mine).tolist()]

    def _end_step(self, is_dummy: bool) -> None:
        if self.eplb is not None:
            self.eplb.end_step(is_dummy)

    # ---- expert load balancing -------------------------------------------------------------

    @rpc(Reduce.SUM_COUNTS, local=True)  # each worker counted its own share of the tokens
    def get_expert_load(self) -> dict[int, list[int]]:
        """Decoder-layer index -> tokens per logical expert over the EPLB window, counted
        on THIS rank (its own tokens' routing; sum over ranks for the global load). Not a
        collective, so it is safe to call at any time. Empty without expert parallelism."""
        return {} if self.eplb is None else self.eplb.local_load()

    def rebalance_experts(self) -> bool:
        """Collective over the EP group (all ranks, same step boundary): rebalance now.
        Returns whether any layer changed. Runs by itself every ``eplb_interval`` steps."""
        if self.eplb is None:
            return False
        return any(self.eplb.rebalance())

    @rpc(Reduce.FIRST, reply=ReplyMode.DRIVER, local=True)
    def get_eplb_info(self) -> dict[str, Any]:
        """Rebalances so far and the current physical -> logical expert layout per layer."""
        eplb = self.eplb
        if eplb is None:
            return {"num_rebalances": 0, "layouts": {}}
        layouts = {
            str(lid): list(p.physical_to_logical) for lid, p in zip(eplb.layer_ids, eplb.placements)
        }
        return {"num_rebalances": eplb.num_rebalances, "layouts": layouts}

    def _prepare_inputs_isolated(
        self, sched: SchedulerOutput, failed: dict[str, str]
    ) -> Inputs | None:
        """The batch's inputs without the requests whose own preparation raises (they go
        to ``failed``); None when none is left."""
        try:
            return self.input_batch.prepare(sched)
        except Exception as e:  # noqa: BLE001 - find the culprit(s) below
            logger.warning("preparing a batch failed (%s); preparing its requests one by one", e)
        good = []
        for sr in sched.scheduled:
            try:
                self.input_batch.prepare([sr])
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                failed[sr.request.request_id] = _error("preparing its inputs", e)
            else:
                good.append(sr)
        # If every request prepares alone but not together, the fault is not a request's:
        # the rebuild raises again and the rank fails, as it should.
        return self.input_batch.prepare(good) if good else None

    def _sample(
        self,
        hidden: torch.Tensor,
        sample_rows: list[int] | np.ndarray,
        reqs: list[ScheduledRequest],
        out: ModelRunnerOutput,
        bitmasks: dict[str, bytes],
    ) -> tuple[list[str], torch.Tensor] | None:
        """The sampled requests' ids and their tokens ([N] int64, on the device; None on
        a TP worker other than the driver, which samples nothing)."""
        # [N] int64: a list (a graph's decode step) or an array (an eager step's). Rows
        # rise strictly (one a request, in order): as many as the hidden states' are all
        # of them, as every decode step has (no gather: two ops fewer a token).
        if len(sample_rows) == hidden.shape[0]:
            picked = hidden
        else:
            rows = torch.as_tensor(sample_rows, dtype=torch.long).to(hidden.device)
            picked = hidden.index_select(0, rows)
        logits = self.model.compute_logits(picked)  # [N, V] float32
        if logits is None:  # a TP worker other than the driver: only the driver samples
            return None
        # Seeded rows draw from fresh per-position generators, so the row-by-row retry
        # draws what an untroubled step would have (seeded = reproducible: docs/architecture.md#elastic-migration).
        try:
            tokens = self._sample_rows(logits, reqs, out, bitmasks)
            return [sr.request.request_id for sr in reqs], tokens
        except Exception as e:  # noqa: BLE001 - find the culprit(s) below
            logger.warning("sampling a batch failed (%s); sampling its rows one by one", e)
        rids: list[str] = []
        parts: list[torch.Tensor] = []
        for i, sr in enumerate(reqs):
            try:
                parts.append(self._sample_rows(logits[i : i + 1], [sr], out, bitmasks))
                rids.append(sr.request.request_id)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                out.failed[sr.request.request_id] = _error("sampling", e)
        return (rids, torch.cat(parts)) if parts else None

    def _sample_rows(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        out: ModelRunnerOutput,
        bitmasks: dict[str, bytes],
    ) -> torch.Tensor:
        """Sample one token for each of ``reqs`` (logits [len(reqs), V]) -> [len(reqs)]
        int64; writes ``out`` (logprobs) only once every row succeeded. ``bitmasks``: the
        grammar-constrained rows'."""
        meta = self.input_batch.sampling_metadata(reqs, bitmasks, logits.device)
        result = self.sampler(logits, meta)
        if any(result.logprobs):  # most steps: no row asked
            for sr, lp in zip(reqs, result.logprobs):
                if lp is not None:
                    out.logprobs[sr.request.request_id] = [lp]
        return result.token_ids

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        prompt_lp: list[tuple[ScheduledRequest, int, int]],
        out: ModelRunnerOutput,
    ) -> None:
        for sr, row0, count in prompt_lp:
            req = sr.request
            try:
                logits = self.model.compute_logits(hidden[row0 : row0 + count])  # [count, V]
                if logits is None:  # not the TP driver
                    continue
                nxt = req.prompt_token_ids[sr.start + 1 : sr.start + 1 + count]
                targets = torch.tensor(nxt, dtype=torch.long, device=logits.device)
                k = req.sampling_params.prompt_logprobs
                assert k is not None  # only requests that asked for them get here
                lps: list[Logprobs] = compute_logprobs(logits, targets, [k] * count)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                out.failed[req.request_id] = _error("computing prompt logprobs", e)
                continue
            out.prompt_logprobs[req.request_id] = lps


class _AloneGroup:
    """The TP group's stand-in while a worker measures its decode step on its own
    (``ModelRunner._graph_pool_estimate``): a step of padding rows needs no peer's sum,
    and an all-reduce allocates nothing (in place), so the bytes are those of the step."""

    def __init__(self, group: Any) -> None:
        self.backend_name, self.rank, self.world_size = (
            group.backend_name, group.rank, group.world_size,
        )  # fmt: skip

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        return t


def fill_placeholders_device(
    ids: torch.Tensor, tokens: torch.Tensor, rows: list[int], src: list[int]
) -> None:
    """``ids[rows] = tokens[src]`` ([T] and [N] int64) by device ops: no host sync."""
    dst = torch.tensor(rows, dtype=torch.long).to(ids.device, non_blocking=True)
    idx = torch.tensor(src, dtype=torch.long).to(ids.device, non_blocking=True)
    ids.index_copy_(0, dst, tokens.index_select(0, idx))


def fill_placeholders_host(
    ids: torch.Tensor, tokens: torch.Tensor, rows: list[int], src: list[int]
) -> None:
    """The same on CPU tensors through numpy views (a torch op costs more than the work)."""
    ids.numpy()[rows] = tokens.numpy()[src]


class _SampledOnDevice(PendingRunnerOutput):
    """A step's output whose sampled ids are still on the device: their copy into pinned
    host memory is queued behind the step now (before the next step is launched, so
    waiting for it never waits for that one) and ``resolve`` waits for the copy alone."""

    def __init__(self, out: ModelRunnerOutput, rids: list[str], tokens: torch.Tensor) -> None:
        self._out, self._rids = out, rids
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens  # [N] int64

    def resolve(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        out = self._out
        for rid, tok in zip(self._rids, self._host.tolist()):
            out.sampled_token_ids[rid] = [tok]
        return out


def num_experts(config: EngineConfig) -> int:
    """The model's number of logical experts (from its config)."""
    spec = get_model_class(config.model.architecture).spec_from_config(config.model.hf_config)
    return spec.num_experts


def initial_placement(config: EngineConfig, ep_size: int) -> ExpertPlacement:
    """Linear placement of the model's experts over ``ep_size`` ranks, with
    ``num_redundant_experts`` extra replicas (and any spare slots) filled evenly."""
    return ExpertPlacement.linear(
        num_experts(config), ep_size, config.parallel.num_redundant_experts
    )


def _error(stage: str, e: Exception) -> str:
    return f"the engine failed {stage} for this request: {type(e).__name__}: {e}"
