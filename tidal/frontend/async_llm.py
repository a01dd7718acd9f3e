"""AsyncLLM: the asyncio frontend the API server drives.

One output-handler task reads engine outputs, runs them through the ``OutputProcessor``
(detokenize, stop strings, n-way merge) and hands each ``RequestOutput`` to the queue of
the request's ``generate()`` iterator. Closing that iterator (client disconnect) aborts the
request in the engine, which frees its KV blocks.

Elastic EP (``--enable-elastic-ep``, docs/architecture.md#elastic): ``scale_elastic_ep`` runs one scale
operation through the ``ScaleDriver`` (``tidal.frontend.scaling.scale_driver``) and answers
``(status_code, record)``; ``is_scaling_elastic_ep``, ``scaling_history`` and
``add_scale_listener`` (every finished operation's record, for the metrics) report on
them. Requests are never refused because of scaling.

Rank recovery (docs/architecture.md#faults) needs no flag: a data-parallel deployment runs the same
driver, whose recovery operations remove dead ranks while the others serve
(``--no-rank-recovery`` turns that off; ``--enable-elastic-ep`` adds the scale API and the
warm launcher on top).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.config import EngineConfig
from tidal.frontend.async_client import AsyncMPClient
from tidal.frontend.output_processor import OutputProcessor
from tidal.frontend.outputs import OutputKind, RequestOutput
from tidal.frontend.processor import InputProcessor, ProcessedPrompt, load_tokenizer
from tidal.frontend.scaling.scale_driver import ScaleDriver, fault_status
from tidal.frontend.scaling.scale_records import ScaleTimeouts
from tidal.moe.placement import engine_token_loads
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import DPCoordinatorStats, EngineCoreOutputs
from tidal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.frontend.tracing import RequestTracer

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError"]

_ELASTIC_OFF = (
    "elastic EP is not enabled: start the server with --enable-elastic-ep "
    "to scale the deployment while it serves"
)


@dataclass
class _Stream:
    request_id: str
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_output: float | None = None  # when its latest tokens came (inter-token latency)
    prompt_tokens: int = 0
    generated: int = 0
    engine: int | None = None  # the engine its latest output came from
    children: int = 1  # engine requests (n); each may run on its own engine
    counted: bool = True  # False: a warm-up request, not in the stats


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        served_model_name: str | None = None,
        client: AsyncMPClient | None = None,
        scale_timeouts: ScaleTimeouts | None = None,
    ) -> None:
        """``scale_timeouts``: the deadlines of elastic EP operations (default
        ``ScaleTimeouts()``)."""
        self.config = config
        self.scale_timeouts = scale_timeouts
        self.served_model_name = served_model_name or config.model.model
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.input_processor = InputProcessor(config.model, self.tokenizer, config.frontend)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = client if client is not None else AsyncMPClient(config)
        self._streams: dict[str, _Stream] = {}
        self._handler: asyncio.Task | None = None
        self._stat_loggers: list[Any] = []
        # Per engine id (the ``engine_id`` of its outputs): its latest SchedulerStats.
        self.latest_stats: dict[int, Any] = {}
        self._scale_driver: ScaleDriver | None = None
        self._scale_listeners: list[Callable[[dict[str, Any]], None]] = []
        # --otlp-traces-endpoint (docs/operations.md#tracing): OpenTelemetry is imported
        # only when it is set.
        self._tracer: RequestTracer | None = None
        if config.frontend.otlp_traces_endpoint:
            from tidal.frontend.tracing import RequestTracer

            self._tracer = RequestTracer(
                config.frontend.otlp_traces_endpoint, self.served_model_name
            )
            self.add_scale_listener(self._tracer.scale_operation)

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
        counted: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate, submit, and stream outputs. Raises ValueError for bad input before the
        first yield, RequestFailedError if the engine refuses or fails the request (any
        of its ``n`` children), and EngineDeadError if the engine dies mid-request.
        ``counted=False``: the stat loggers do not see it (``warm_up``'s)."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        self.input_processor.check(prompt, params)
        self.check_data_parallel_rank(data_parallel_rank)
        request_id = request_id or uuid.uuid4().hex
        self._ensure_handler()
        children = self.output_processor.add_request(
            request_id, prompt.prompt, prompt.prompt_token_ids, params, output_kind
        )
        stream = _Stream(
            request_id,
            prompt_tokens=len(prompt.prompt_token_ids),
            children=len(children),
            counted=counted,
        )
        self._streams[request_id] = stream
        tracer = self._tracer
        if tracer is not None:
            tracer.start(request_id, stream.prompt_tokens)
        finished = False
        try:
            for req in self.input_processor.make_requests(
                children, prompt, params, data_parallel_rank
            ):
                self.client.add_request(req)
            if tracer is not None:
                tracer.event(request_id, "queued")
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
            if tracer is not None:  # ends the span unless its finish did
                tracer.finish(request_id, stream.generated, "abort")

    async def abort(self, request_id: str) -> None:
        self._abort_children(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(asyncio.CancelledError())

    def abort_all(self, message: str) -> int:
        """End every request in flight now, each stream with a last output whose finish
        reason is ``abort`` and stop reason ``message`` (the drain timed out); returns
        how many."""
        outputs, running = self.output_processor.finish_all(message)
        if running and not self.is_dead:
            self.client.abort_requests(running)
        now = time.monotonic()
        for ro in outputs:
            stream = self._streams.get(ro.request_id)
            if stream is not None:
                # The engine of its latest output; one that never had any is counted on
                # the first live engine (the metrics label every request with one).
                engine = stream.engine
                self._record(
                    stream,
                    ro,
                    now,
                    self.client.topology.engine_ids[0] if engine is None else engine,
                )
                stream.queue.put_nowait(ro)
        return len(outputs)

    async def sleep(self, level: int = 1) -> int:
        """Free the KV cache on every rank, level 2 the weights too
        (docs/operations.md#sleep-mode); only while no request runs. Returns the bytes
        freed, all ranks together."""
        return sum(await self.client.call_utility_all_async("sleep", level))

    async def wake_up(self) -> None:
        """Make every rank's KV cache again; serving continues as before the sleep."""
        await self.client.call_utility_all_async("wake_up")

    async def is_sleeping(self) -> bool:
        return any(await self.client.call_utility_all_async("is_sleeping"))

    async def warm_up(self) -> None:
        """One greedy token on every rank (pinned to each), not counted in the stats:
        returns once each has served a step (``/ready``, docs/operations.md#lifecycle)."""
        prompt = ProcessedPrompt(None, [self.input_processor.eos_token_id or 0])
        params = SamplingParams(max_tokens=1, temperature=0.0)

        async def one(rank: int) -> None:
            async for _ in self.generate(
                prompt,
                params,
                f"warm-up-{rank}-{uuid.uuid4().hex}",
                data_parallel_rank=rank,
                counted=False,
            ):
                pass

        await asyncio.gather(*(one(r) for r in range(self.client.topology.size)))
        # The sizing each rank resolved (docs/operations.md#kv-sizing), in the server's log.
        for engine_id in self.client.topology.engine_ids:
            kv = await self.client.call_utility_async("get_kv_cache_info", engine=engine_id)
            logger.info(
                "engine %d: KV cache per rank: %d blocks, %d tokens, %d bytes (%.1f MiB)",
                engine_id,
                kv["num_blocks"],
                kv["tokens"],
                kv["bytes"],
                kv["bytes"] / 2**20,
            )

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

    async def get_engine_expert_load(self, load: dict[int, list[int]]) -> dict[int, float]:
        """Engine id -> tokens routed to the experts its EP ranks hold (``load``: the
        ``get_expert_load`` records), over the EPLB window, summed over layers, under the
        placement the first engine reports now (every rank holds the same one). Empty while
        an elastic resize has the layout and the engines out of step."""
        info = await self.client.call_utility_async("get_eplb_info")
        engines = list(self.client.topology.engine_ids)
        layouts = {int(k): v for k, v in info["layouts"].items()}
        tp = self.config.parallel.tensor_parallel_size
        try:
            tokens = engine_token_loads(layouts, load, len(engines), tp)
        except ValueError:  # mid-resize: the layout is for another EP size; next scrape
            logger.debug("expert layout does not fit %d engines now", len(engines))
            return {}
        return dict(zip(engines, tokens))

    async def get_stats(self) -> dict[str, Any]:
        """``/stats``: per-rank load, wave state (the coordinator's view with DP), each
        rank's processes (its engine's pid, its TP size and its workers' pids) and, with
        expert parallelism, the expert load."""
        stats = await self._load_stats()
        self._add_processes(stats)
        if self.elastic_ep_enabled:
            stats["is_scaling_elastic_ep"] = self.is_scaling_elastic_ep()
            stats["scaling_history"] = self.scaling_history()
        if self.has_expert_load:
            load = await self.get_expert_load()
            stats["expert_load"] = {str(k): v for k, v in load.items()}
            by_engine = await self.get_engine_expert_load(load)
            stats["expert_load_by_engine"] = {str(k): v for k, v in by_engine.items()}
        # Per rank: blocks, block size, cache layout and bytes per token (MLA's latent).
        stats["kv_cache"] = await self.client.call_utility_all_async("get_kv_cache_info")
        # Per rank: decode graphs replayed and eager steps by reason.
        stats["cuda_graphs"] = await self.client.call_utility_all_async("get_graph_stats")
        if self.config.device == "cpu":
            # Each rank's path per op and the trial's timings (tidal/kernels/select.py).
            stats["cpu_kernels"] = await self.get_cpu_kernels()
        return stats

    async def get_cpu_kernels(self) -> list[dict[str, Any] | None]:
        """Each rank's CPU path per op and the trial's timings (tidal/kernels/select.py)."""
        return await self.client.call_utility_all_async("get_cpu_kernels")

    def processes(self) -> dict[int, dict[str, Any]]:
        """Engine id -> its process (``pid``, None when not known here), the node it runs
        on (``node``: the Ray node id on Ray, else its host name) and its workers'
        (``worker_pids``, TP rank order), for every engine the frontend has seen ready."""
        manager = getattr(self.client, "manager", None)
        engine_pids = dict(getattr(manager, "engine_pids", {}))
        worker_pids = dict(getattr(manager, "worker_pids", {}))
        nodes = getattr(manager, "nodes", dict)()
        return {
            e: {
                "pid": engine_pids.get(e),
                "node": nodes.get(e),
                "worker_pids": list(worker_pids.get(e, [])),
            }
            for e in sorted(set(engine_pids) | set(worker_pids))
        }

    def _add_processes(self, stats: dict[str, Any]) -> None:
        tp = self.config.parallel.tensor_parallel_size
        procs = self.processes()
        stats["tensor_parallel_size"] = tp
        for rank in stats.get("ranks", []):
            rank["tensor_parallel_size"] = tp
            rank.update(
                procs.get(rank["engine_id"], {"pid": None, "node": None, "worker_pids": []})
            )

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
                    "generation_tokens_total": s.num_generation_tokens_total if s else 0,
                }
            )
        return {
            "data_parallel_size": topology.size,
            "epoch": topology.epoch,
            "wave": 0,
            "engines_running": any(r["running"] or r["waiting"] for r in ranks),
            "ranks": ranks,
        }

    # ---- elastic EP (docs/architecture.md#elastic-api) --------------------------------------------------------

    @property
    def elastic_ep_enabled(self) -> bool:
        return self.config.parallel.enable_elastic_ep

    @property
    def drives_reconfiguration(self) -> bool:
        """Whether a scale driver runs: elastic EP, or a data-parallel deployment that
        recovers from rank deaths."""
        return self.config.parallel.reconfigurable

    async def scale_elastic_ep(
        self,
        new_data_parallel_size: int,
        drain_timeout: float = 0.0,
        operation_id: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Grow or shrink the deployment to ``new_data_parallel_size`` engines while it
        serves; returns when the operation ended: ``(200, record)`` with ``record["result"]``
        ``succeeded`` | ``rolled_back`` | ``failed`` (and its ``cause``). A repeated
        ``operation_id`` answers its first record at once (also while it runs); another
        operation running answers ``(409, that operation's record)``. ``ValueError`` (HTTP
        400) when elastic EP is off or the request cannot be served (size, drain timeout,
        operation id), naming the valid range."""
        if not self.elastic_ep_enabled:
            raise ValueError(_ELASTIC_OFF)
        driver = self.scale_driver
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        self._ensure_handler()  # outputs of migrated requests must keep flowing
        resp = await driver.scale(new_data_parallel_size, drain_timeout, operation_id)
        return resp.status_code, resp.record.to_dict()

    def is_scaling_elastic_ep(self) -> bool:
        """``/is_scaling_elastic_ep``: an operation runs (or its outcome is still unknown)."""
        return self._scale_driver is not None and self._scale_driver.is_scaling

    def scaling_history(self) -> list[dict[str, Any]]:
        """Scale operations (records as ``scale_elastic_ep`` answers them), oldest first;
        a running one is last with its current phase."""
        return [] if self._scale_driver is None else self._scale_driver.history()

    def fault_status(self) -> dict[str, Any]:
        """Rank deaths and their recoveries (``scale_driver.fault_status`` lists the keys)."""
        return fault_status(self.client, self._scale_driver)

    def add_scale_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """``listener(record)`` on the event loop each time an operation ends (and again if
        an unknown outcome is learnt later): the record ``scale_elastic_ep`` answers."""
        self._scale_listeners.append(listener)
        if self._scale_driver is not None:
            self._scale_driver.add_listener(listener)

    @property
    def scale_driver(self) -> ScaleDriver:
        """The driver of scale and recovery operations (created on first use);
        ``ValueError`` when neither elastic EP nor rank recovery runs."""
        if not self.drives_reconfiguration:
            raise ValueError(_ELASTIC_OFF)
        if self._scale_driver is None:
            driver = ScaleDriver.for_client(self.config, self.client, self.scale_timeouts)
            driver.add_listener(self._on_scale_record)
            for listener in self._scale_listeners:
                driver.add_listener(listener)
            self._scale_driver = driver
        return self._scale_driver

    def _on_scale_record(self, record: dict[str, Any]) -> None:
        # Engines that left keep no row in the per-engine stats.
        members = set(self.client.topology.engine_ids)
        for engine_id in [e for e in self.latest_stats if e not in members]:
            del self.latest_stats[engine_id]

    async def shutdown(self) -> None:
        if self._scale_driver is not None:
            self._scale_driver.close()
        if self._handler is not None:
            self._handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._handler
        self.client.shutdown()
        if self._tracer is not None:
            # Sends what is left; off the loop: it may wait on the collector.
            await asyncio.to_thread(self._tracer.shutdown)

    # ---- internals ---------------------------------------------------------------------

    def check_data_parallel_rank(self, rank: int | None) -> None:
        """A request may be pinned to ``rank``: ``ValueError`` (HTTP 400) outside the live
        size, ``RankUnavailableError`` (HTTP 503) while its engine is dead (the deployment
        recovers without it). A leaving rank is fine: the request goes elsewhere."""
        if rank is None:
            return
        size = self.client.topology.size  # the live size: a rank is a position in it
        if not 0 <= rank < size:
            raise ValueError(f"data_parallel_rank must be in [0, {size}), got {rank}")
        self.client.check_pinned_rank(rank)

    def _abort_children(self, request_id: str) -> None:
        children = self.output_processor.abort(request_id)
        if children and not self.is_dead:
            self.client.abort_requests(children)

    def start(self) -> None:
        """On the running loop, before the first request (the API server's startup):
        read outputs, send heartbeats to the engines and, with elastic EP, let the
        scale driver watch for rank deaths from now on. Idempotent."""
        self._ensure_handler()

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._output_handler())
            if self.drives_reconfiguration and not self.is_dead:
                # From the first request on, a rank death is the driver's to recover
                # from (docs/architecture.md#faults), not the end of the client.
                self.scale_driver.start()

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

    def _counted(self, engine_request_id: str) -> bool:
        """False for a warm-up request's (``warm_up``): the stats never see those."""
        parent = self.output_processor.parent_of(engine_request_id) or engine_request_id
        stream = self._streams.get(parent)
        return stream is None or stream.counted

    def _handle(self, outs: EngineCoreOutputs) -> None:
        if outs.scheduler_stats is not None:
            self.latest_stats[outs.engine_id] = outs.scheduler_stats
            for sl in self._stat_loggers:
                sl.record_scheduler_stats(outs.engine_id, outs.scheduler_stats)
        if not outs.outputs:
            return
        for out in outs.outputs:
            if out.timings is not None and self._counted(out.request_id):
                for sl in self._stat_loggers:  # an engine request finished: its phases there
                    sl.record_request_timings(outs.engine_id, out.timings)
        processed = self.output_processor.process_outputs(outs.outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        now = time.monotonic()
        for ro in processed.request_outputs:
            stream = self._streams.get(ro.request_id)
            if stream is None:
                continue
            self._record(stream, ro, now, outs.engine_id)
            stream.queue.put_nowait(ro)
        for err in processed.failed:
            stream = self._streams.get(err.request_id)
            if stream is None:
                continue
            if stream.counted:
                self._record_finished(stream, now, "error", outs.engine_id, str(err))
            stream.queue.put_nowait(err)

    def _record(self, stream: _Stream, ro: RequestOutput, now: float, engine: int) -> None:
        """``engine``: the id of the engine whose output this is."""
        new_tokens = sum(len(c.token_ids) for c in ro.outputs)
        if not stream.counted:  # a warm-up request
            return
        tracer = self._tracer
        if tracer is not None and stream.children == 1 and stream.engine not in (None, engine):
            # Its outputs come from another engine now: elastic EP moved it.
            tracer.event(stream.request_id, "migrated", {"from": stream.engine, "to": engine})
        stream.engine = engine
        if new_tokens:
            if stream.first_token is None:
                stream.first_token = now
                if tracer is not None:
                    tracer.event(stream.request_id, "first_token", {"engine": engine})
            elif stream.last_output is not None:
                for sl in self._stat_loggers:
                    sl.record_inter_token(
                        engine, (now - stream.last_output) / new_tokens, new_tokens
                    )
            stream.last_output = now
        stream.generated += new_tokens
        for sl in self._stat_loggers:
            sl.record_tokens(0, new_tokens, engine)
        if ro.finished:
            reason = ro.outputs[0].finish_reason if ro.outputs else "abort"
            self._record_finished(stream, now, reason or "stop", engine)

    def _record_finished(
        self, stream: _Stream, now: float, reason: str, engine: int, error: str | None = None
    ) -> None:
        if self._tracer is not None:
            self._tracer.finish(stream.request_id, stream.generated, reason, error)
        ttft = (stream.first_token or now) - stream.arrival
        decode = stream.generated - 1
        tpot = (now - stream.first_token) / decode if decode > 0 and stream.first_token else None
        for sl in self._stat_loggers:
            sl.record_tokens(stream.prompt_tokens, 0, engine)
            sl.record_request_finished(
                stream.prompt_tokens,
                stream.generated,
                ttft,
                now - stream.arrival,
                tpot,
                reason,
                engine,
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
                "generation_tokens_total": r.generation_tokens_total,
                "history": [[round(st.timestamp - t, 3), w, n] for t, w, n in r.history],
            }
            for r in st.ranks
        ],
    }
