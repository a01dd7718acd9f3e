"""AsyncLLM: the asyncio frontend the API server drives.

One output-handler task reads engine outputs, runs them through the ``OutputProcessor``
(detokenize, stop strings, n-way merge) and hands each ``RequestOutput`` to the queue of
the request's ``generate()`` iterator. Closing that iterator (client disconnect) aborts the
request in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from tidal.config import EngineConfig
from tidal.frontend.async_client import AsyncMPClient
from tidal.frontend.output_processor import OutputProcessor
from tidal.frontend.outputs import OutputKind, RequestOutput
from tidal.frontend.processor import InputProcessor, ProcessedPrompt, load_tokenizer
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import DPCoordinatorStats, EngineCoreOutputs
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError"]


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    prompt_tokens: int = 0
    generated: int = 0


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        served_model_name: str | None = None,
        client: AsyncMPClient | None = None,
    ) -> None:
        self.config = config
        self.served_model_name = served_model_name or config.model.model
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.input_processor = InputProcessor(config.model, self.tokenizer, config.frontend)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = client if client is not None else AsyncMPClient(config)
        self._streams: dict[str, _Stream] = {}
        self._handler: asyncio.Task | None = None
        self._stat_loggers: list[Any] = []
        self.latest_stats: dict[int, Any] = {}

    # ---- public API --------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.client.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    def add_stat_logger(self, stat_logger: Any) -> None:
        self._stat_loggers.append(stat_logger)

    async def generate(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        output_kind: OutputKind = OutputKind.DELTA,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate, submit, and stream outputs. Raises ValueError for bad input before the
        first yield, RequestFailedError if the engine refuses or fails the request (any
        of its ``n`` children), and EngineDeadError if the engine dies mid-request."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        self.input_processor.check(prompt, params)
        self._check_dp_rank(data_parallel_rank)
        request_id = request_id or uuid.uuid4().hex
        self._ensure_handler()
        children = self.output_processor.add_request(
            request_id, prompt.prompt, prompt.prompt_token_ids, params, output_kind
        )
        stream = _Stream(prompt_tokens=len(prompt.prompt_token_ids))
        self._streams[request_id] = stream
        finished = False
        try:
            for req in self.input_processor.make_requests(
                children, prompt, params, data_parallel_rank
            ):
                self.client.add_request(req)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_children(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_children(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(asyncio.CancelledError())

    @property
    def has_expert_load(self) -> bool:
        # EP size = the live DP size (the topology's), which elastic EP may change.
        return self.config.parallel.enable_expert_parallel and self.client.topology.size > 1

    async def get_expert_load(self) -> dict[int, list[int]]:
        """Per layer, tokens routed to each logical expert over the EPLB window, summed
        over the ranks (each rank counts the tokens its own batches routed)."""
        per_rank = await self.client.call_utility_all_async("get_expert_load")
        total: dict[int, list[int]] = {}
        for load in per_rank:
            for layer, counts in load.items():
                acc = total.setdefault(int(layer), [0] * len(counts))
                for e, n in enumerate(counts):
                    acc[e] += n
        return dict(sorted(total.items()))

    async def get_stats(self) -> dict[str, Any]:
        """``/stats``: per-rank load, wave state (the coordinator's view with DP) and, with
        expert parallelism, the expert load."""
        stats = await self._load_stats()
        if self.has_expert_load:
            stats["expert_load"] = {str(k): v for k, v in (await self.get_expert_load()).items()}
        return stats

    async def _load_stats(self) -> dict[str, Any]:
        if getattr(self.client, "coordinator", None) is not None:
            return _dp_stats_json(await self.client.get_dp_stats_async())
        topology = self.client.topology
        ranks = []
        for rank, engine_id in enumerate(topology.engine_ids):
            s = self.latest_stats.get(engine_id)
            ranks.append(
                {
                    "rank": rank,
                    "engine_id": engine_id,
                    "waiting": s.num_waiting_reqs if s else 0,
                    "running": s.num_running_reqs if s else 0,
                    "kv_usage": s.kv_cache_usage if s else 0.0,
                    "requests_total": s.num_requests_total if s else 0,
                }
            )
        return {
            "data_parallel_size": topology.size,
            "epoch": topology.epoch,
            "wave": 0,
            "engines_running": any(r["running"] or r["waiting"] for r in ranks),
            "ranks": ranks,
        }

    async def shutdown(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._handler
        self.client.shutdown()

    # ---- internals ---------------------------------------------------------------------

    def _check_dp_rank(self, rank: int | None) -> None:
        if rank is None:
            return
        size = self.client.topology.size  # the live size: a rank is a position in it
        if not 0 <= rank < size:
            raise ValueError(f"data_parallel_rank must be in [0, {size}), got {rank}")

    def _abort_children(self, request_id: str) -> None:
        children = self.output_processor.abort(request_id)
        if children and not self.is_dead:
            self.client.abort_requests(children)

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._output_handler())

    async def _output_handler(self) -> None:
        try:
            while True:
                outs = await self.client.get_output_async()
                self._handle(outs)
        except EngineDeadError as e:
            self._fail_all(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a frontend bug must not hang every client
            logger.exception("output handler failed")
            self._fail_all(EngineDeadError(f"frontend output handler failed: {e}"))

    def _handle(self, outs: EngineCoreOutputs) -> None:
        if outs.scheduler_stats is not None:
            self.latest_stats[outs.engine_index] = outs.scheduler_stats
            for sl in self._stat_loggers:
                sl.record_scheduler_stats(outs.engine_index, outs.scheduler_stats)
        if not outs.outputs:
            return
        processed = self.output_processor.process_outputs(outs.outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        now = time.monotonic()
        for ro in processed.request_outputs:
            stream = self._streams.get(ro.request_id)
            if stream is None:
                continue
            self._record(stream, ro, now)
            stream.queue.put_nowait(ro)
        for err in processed.failed:
            stream = self._streams.get(err.request_id)
            if stream is None:
                continue
            self._record_finished(stream, now, "error")
            stream.queue.put_nowait(err)

    def _record(self, stream: _Stream, ro: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in ro.outputs)
        if new_tokens and stream.first_token is None:
            stream.first_token = now
        stream.generated += new_tokens
        for sl in self._stat_loggers:
            sl.record_tokens(0, new_tokens)
        if ro.finished:
            reason = ro.outputs[0].finish_reason if ro.outputs else "abort"
            self._record_finished(stream, now, reason or "stop")

    def _record_finished(self, stream: _Stream, now: float, reason: str) -> None:
        ttft = (stream.first_token or now) - stream.arrival
        decode = stream.generated - 1
        tpot = (now - stream.first_token) / decode if decode > 0 and stream.first_token else None
        for sl in self._stat_loggers:
            sl.record_tokens(stream.prompt_tokens, 0)
            sl.record_request_finished(
                stream.prompt_tokens, stream.generated, ttft, now - stream.arrival, tpot, reason
            )

    def _fail_all(self, err: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(err)


def _dp_stats_json(st: DPCoordinatorStats) -> dict[str, Any]:
    return {
        "data_parallel_size": st.num_engines,
        "epoch": st.epoch,
        "wave": st.wave,
        "engines_running": st.running,
        "waves_completed": st.waves_completed,
        "ranks": [
            {
                "rank": r.rank,
                "engine_id": r.engine_id,
                "waiting": r.waiting,
                "running": r.running,
                "kv_usage": r.kv_usage,
                "requests_total": r.requests_total,
                "history": [[round(st.timestamp - t, 3), w, n] for t, w, n in r.history],
            }
            for r in st.ranks
        ],
    }
