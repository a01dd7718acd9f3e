"""EngineCore: one DP rank's brain. schedule -> execute -> update, nothing else.

No sockets and no threads here: ``EngineCoreProc`` (proc.py) wraps it with I/O, and the
in-process client calls it directly.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from tidal.config import EngineConfig
from tidal.distributed.groups import GroupFailure
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.engine_core.structured import GrammarBackend
from tidal.executor.base import Executor
from tidal.executor.batch import ModelRunnerOutput, PendingRunnerOutput, SchedulerOutput
from tidal.executor.select import create_executor
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def kv_group_windows(layout: dict[str, Any]) -> list[int | None]:
    """The KV cache groups' windows (None: full attention) from ``runner.kv_cache_info``."""
    groups = layout.get("kv_groups")
    if groups:
        return [g["sliding_window"] for g in groups]
    return [layout.get("sliding_window")]


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
    ) -> None:
        t0 = time.monotonic()
        self.config = config
        self.executor = executor or create_executor(config)
        self.num_blocks = self.executor.call("runner.determine_num_blocks")
        self.executor.call("worker.initialize_kv_cache", self.num_blocks)
        self.vocab_size = int(config.model.hf_config.vocab_size)
        self.grammars = GrammarBackend(
            config.model.tokenizer, self.vocab_size, config.model.eos_token_ids
        )
        # runner.kv_cache_info, fixed for the engine's life (kept: asked while awake).
        self._kv_layout: dict[str, Any] = self.executor.call("runner.kv_cache_info")
        kv_windows = kv_group_windows(self._kv_layout)
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_blocks, self.grammars, kv_windows=kv_windows
        )
        # Async scheduling: the step launched last and not yet processed.
        self._pending: tuple[SchedulerOutput, PendingRunnerOutput] | None = None
        self.kv_cache_bytes: int = self.executor.call("runner.kv_cache_bytes", self.num_blocks)
        self.sleeping = False  # the KV cache is freed (sleep mode)
        self.weights_freed = False  # and the weights (sleep level 2)
        # Block 0 is the null block: the others hold tokens, a block of each KV cache
        # group per block_size tokens (before any is freed behind a window).
        self.num_kv_tokens = (self.num_blocks - 1) // len(kv_windows) * config.cache.block_size
        logger.info(
            "engine core ready in %.2fs: KV cache per rank: %d blocks, %d tokens, %d bytes "
            "(%.1f MiB)",
            time.monotonic() - t0,
            self.num_blocks,
            self.num_kv_tokens,
            self.kv_cache_bytes,
            self.kv_cache_bytes / 2**20,
        )

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue. Raises ValueError with a user-facing message."""
        if self.sleeping:  # the server refuses them first; a direct caller learns why here
            raise RuntimeError("the engine is asleep: wake_up first")
        self.scheduler.add_request(self.make_request(req))

    def make_request(self, req: EngineCoreRequest) -> Request:
        # Sizes first, by length alone: no per-item check walks a huge list.
        params = req.sampling_params
        self.config.frontend.check_sizes(
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            extra_stop_token_ids=len(self.config.model.eos_token_ids),
        )
        validate_request(req, self.config.model.max_model_len, self.vocab_size)
        # Rebuilding the params re-runs their own range checks on what came off the wire.
        # A structured_outputs spec is checked again by its compile, off this thread (a
        # spec that does not compile fails this request alone: docs/architecture.md#structured-outputs).
        params = SamplingParams(**_struct_fields(req.sampling_params))
        return Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=params,
            eos_token_id=req.eos_token_id,
            client_index=req.client_index,
            arrival_time=req.arrival_time or None,
            max_model_len=self.config.model.max_model_len,
            current_wave=req.current_wave,
            num_output_tokens=req.num_output_tokens,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    # ---- stepping ----------------------------------------------------------------------

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One schedule -> execute -> update. Returns outputs per client index and whether
        the model ran (a rank with nothing scheduled returns ({}, False)). With async
        scheduling the update is the previous step's (``_step_async``)."""
        if self.scheduler.async_scheduling:
            return self._step_async()
        # has_requests also covers finished-but-unreported requests (abort notices).
        if not self.scheduler.has_requests():
            return {}, False
        sched = self.scheduler.schedule()
        try:
            runner_out = self.executor.call("runner.execute_model", sched)
        except GroupFailure:
            self.scheduler.abandon_step(sched)  # its tokens never reach the scheduler
            raise
        outputs = self.scheduler.update_from_output(sched, runner_out)
        return outputs, sched.total_num_scheduled_tokens > 0

    def _step_async(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedule and launch step n+1, then wait for step n and process its output
        (docs/architecture.md#async-scheduling): the host copy of n's sampled ids and the
        outputs are built while n+1 runs. "The model ran" is whether n+1 was launched, so a
        DP rank runs exactly one forward per busy-loop pass, as without async."""
        pending, self._pending = self._pending, None
        sched: SchedulerOutput | None = None
        launched: PendingRunnerOutput | None = None
        if self.scheduler.has_requests():
            sched = self.scheduler.schedule()
            if not sched.is_empty:
                try:
                    launched = self.executor.call("runner.execute_model_async", sched)
                except GroupFailure:
                    self.scheduler.abandon_step(sched)  # and the pending one: dropped
                    raise
        outputs: dict[int, EngineCoreOutputs] = {}
        if pending is not None:
            try:
                output = pending[1].resolve()
            except GroupFailure:
                self.scheduler.abandon_step(sched)
                raise
            outputs = self.scheduler.update_from_output(pending[0], output)
        if launched is not None:
            assert sched is not None
            self._pending = (sched, launched)
        elif sched is not None and pending is None:
            # Nothing launched nor processed: the finish notices and failures still go out.
            outputs = self.scheduler.update_from_output(sched, ModelRunnerOutput())
        return outputs, launched is not None

    def abandon_step(self) -> None:
        """A collective failed (docs/architecture.md#faults): the step in flight, if any,
        never completes; every running request is preempted by recompute."""
        self._pending = None
        self.scheduler.abandon_step()

    def execute_dummy_batch(self) -> None:
        self.executor.call("runner.execute_dummy_batch")

    def has_unfinished_requests(self) -> bool:
        """Requests here, or a launched step still to process (async scheduling)."""
        return self.scheduler.has_unfinished_requests() or self._pending is not None

    # ---- utility methods (callable by name from clients) -------------------------------

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        self.scheduler.reset_prefix_cache()
        return True

    def get_expert_load(self) -> dict[int, list[int]]:
        """Per layer, tokens routed to each logical expert over the EPLB window (this rank)."""
        return self.executor.call("runner.get_expert_load")

    def get_eplb_info(self) -> dict[str, Any]:
        """Rebalances so far and the current physical -> logical expert layout per layer."""
        return self.executor.call("runner.get_eplb_info")

    def get_graph_stats(self) -> dict[str, Any]:
        """Decode graphs (``/stats`` ``cuda_graphs``; docs/architecture.md#cuda-graphs):
        sizes captured, steps replayed, eager steps by reason."""
        return self.executor.call("runner.graph_stats")

    def get_cpu_kernels(self) -> dict[str, Any] | None:
        """The CPU path serving each op, with the trial's timings (``/stats``)."""
        return self.executor.call("worker.get_cpu_kernels")

    def sleep(self, level: int) -> int:
        """Sleep mode (docs/operations.md#sleep-mode): free the KV cache on every worker;
        level 2 drops the weights too (``wake_up`` reloads them from the checkpoint). Only
        when no request is here: raises otherwise. Returns the bytes freed (0 if already
        asleep)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self.sleeping:
            return 0
        if self.has_unfinished_requests():
            raise RuntimeError("requests are running; sleep when the engine is idle")
        self.scheduler.reset_prefix_cache()  # the blocks' contents are gone
        freed: int = self.executor.call("worker.free_kv_cache")
        self.sleeping = True
        weights = 0
        if level == 2:
            weights = self.executor.call("worker.free_weights")
            self.weights_freed = True
        logger.info(
            "asleep (level %d): freed %d bytes of KV cache, %d of weights", level, freed, weights
        )
        return freed + weights

    def wake_up(self) -> bool:
        """Make the KV cache again (zeroed, as at start); False if it was awake."""
        if not self.sleeping:
            return False
        if self.weights_freed:
            self.executor.call("worker.reload_weights")
            self.weights_freed = False
        self.executor.call("worker.initialize_kv_cache", self.num_blocks)
        self.sleeping = False
        logger.info("awake: %d KV blocks", self.num_blocks)
        return True

    def is_sleeping(self) -> bool:
        return self.sleeping

    def get_num_blocks(self) -> int:
        return self.num_blocks

    def get_kv_cache_info(self) -> dict[str, Any]:
        """This rank's KV cache (``/stats``, the start log; docs/architecture.md#kv-cache-layouts):
        the driver worker's layout and bytes per token, ``num_blocks`` (with the null block),
        the ``tokens`` they hold, ``bytes`` over its workers and the ``block_size``; with
        KV cache groups, ``kv_groups``: each one's window, layers, blocks held now and
        blocks freed behind its window so far."""
        block_size = self.config.cache.block_size
        info = {
            **self._kv_layout,
            "num_blocks": self.num_blocks,
            "tokens": self.num_kv_tokens,
            "bytes": self.kv_cache_bytes,
            "block_size": block_size,
        }
        groups = self._kv_layout.get("kv_groups")
        if groups:  # KV cache groups: the blocks each holds now, and has freed so far
            kv = self.scheduler.kv_cache_manager
            info["kv_groups"] = [
                {**g, "blocks": kv.blocks_by_group[i], "window_freed_blocks": freed}
                for i, (g, freed) in enumerate(zip(groups, kv.window_freed_by_group))
            ]
        return info

    def echo(self, value: Any) -> Any:
        return value

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def validate_request(req: EngineCoreRequest, max_model_len: int, vocab_size: int) -> None:
    """The engine's own checks of a request handed to it (defence in depth: the frontend
    checked already, but the engine must not trust its peer). Raises ``ValueError``
    naming the field. Every field is checked by its value's type, so a field added to
    the params later is covered too: ints must fit int64 (torch tensors, struct
    packing), floats must be finite; then the checks that need the model's limits."""
    if not isinstance(req.request_id, str) or not req.request_id:
        raise ValueError("request_id must be a non-empty string")
    for name in _field_names(req):
        # The prompt's ids get the stricter vocabulary check in validate_prompt.
        if name not in ("sampling_params", "prompt_token_ids"):
            _check_representable(name, getattr(req, name))
    params = req.sampling_params
    for name in _field_names(params):
        _check_representable(name, getattr(params, name))
    validate_prompt(req.prompt_token_ids, max_model_len, vocab_size)
    if req.eos_token_id is not None and req.eos_token_id < 0:
        raise ValueError(f"eos_token_id must be >= 0, got {req.eos_token_id}")
    # A resumed request keeps at least one real prompt token and has output left to make.
    k = req.num_output_tokens
    if not 0 <= k < len(req.prompt_token_ids):
        raise ValueError(
            f"num_output_tokens must be in [0, {len(req.prompt_token_ids)}) (the prompt's "
            f"length), got {k}"
        )
    max_tokens = getattr(params, "max_tokens", None)
    if max_tokens is not None and k >= max_tokens:
        raise ValueError(
            f"num_output_tokens ({k}) must be below max_tokens ({max_tokens}): "
            "the request has nothing left to generate"
        )
    for name in ("allowed_token_ids", "logit_bias"):
        bad = next((t for t in getattr(params, name, None) or () if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is out of range for vocab size {vocab_size}")
    words = getattr(params, "bad_words_token_ids", ())
    bad = next((t for w in words for t in w if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"bad_words_token_ids: token id {bad} is out of range for vocab size {vocab_size}"
        )
    top_k = getattr(params, "top_k", 0)
    if top_k is not None and not -1 <= top_k <= vocab_size:
        raise ValueError(
            f"top_k must be -1 or 0 (disabled) or in [1, {vocab_size}] (the vocabulary), "
            f"got {top_k}"
        )


def _check_representable(name: str, value: Any) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, (str, bytes)):
        return
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"{name} must fit in a 64-bit integer, got {value}")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _check_representable(name, v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_representable(name, k)
            _check_representable(name, v)


def _field_names(obj: Any) -> tuple[str, ...]:
    """Field names of a msgspec Struct or a dataclass (whatever the params type is)."""
    names = getattr(obj, "__struct_fields__", None)
    if names is None:
        names = tuple(getattr(obj, "__dataclass_fields__", {}))
    return names


def validate_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt must not be empty")
    if n >= max_model_len:
        raise ValueError(
            f"prompt is {n} tokens, which leaves no room to generate within the model's "
            f"maximum context length of {max_model_len} tokens"
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range for vocab size {vocab_size}")


def _struct_fields(s: Any) -> dict[str, Any]:
    return {f: getattr(s, f) for f in _field_names(s)}
