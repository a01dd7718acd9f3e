"""Offline inference: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import typing
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tidal.config import EngineConfig
from tidal.frontend.core_client import EngineCoreClient, InprocClient
from tidal.frontend.loop_client import LoopThreadClient
from tidal.frontend.output_processor import OutputProcessor
from tidal.frontend.outputs import OutputKind, RequestOutput
from tidal.frontend.processor import InputProcessor, PromptType, load_tokenizer
from tidal.launch.engine_args import EngineArgs
from tidal.sampling_params import SamplingParams


class LLM:
    """Generate from a Hugging Face MoE checkpoint folder (or the embedded default model).

    Keyword arguments are ``EngineArgs`` fields (``max_num_seqs``, ``data_parallel_size``,
    ``enable_expert_parallel``, ...). ``multiprocess`` says where the engine core runs:
    ``True`` in its own process (data-parallel and elastic deployments always do), ``False``
    in this process, ``None`` (the default) chooses -- see ``runs_in_process``. Engine
    processes are driven by the server's engine client (``LoopThreadClient``), so
    failures are handled exactly as the server handles them: a data-parallel deployment
    survives the death of ranks (``rank_recovery``, on by default) -- the dead ranks are
    removed while the others serve, and their requests finish elsewhere -- and where
    nothing can serve, ``generate`` raises ``EngineDeadError``.

    The engines stop at ``shutdown()``, at the end of a ``with LLM(...) as llm:`` block,
    when the ``LLM`` is garbage-collected (``del llm``), or at interpreter exit, whichever
    comes first: a script needs neither a ``__main__`` guard nor a ``shutdown()`` call."""

    def __init__(
        self, model: str | None = None, *, multiprocess: bool | None = None, **kwargs: Any
    ) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        self.multiprocess = (
            not runs_in_process(self.config) if multiprocess is None else multiprocess
        )
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        self.input_processor = InputProcessor(
            self.config.model, self.tokenizer, self.config.frontend
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client: EngineCoreClient = self._make_client()
        # Holds the client, not self: the LLM stays collectable and its collection (or
        # interpreter exit) shuts the client down.
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        self._ids = itertools.count()

    def _make_client(self) -> EngineCoreClient:
        if self.config.parallel.is_data_parallel and not self.multiprocess:
            raise ValueError(
                "multiprocess=False supports data_parallel_size=1 without enable_elastic_ep only"
            )
        if not self.multiprocess:
            return InprocClient(self.config)
        # The server's engine client on a loop of its own, so a rank death is survived
        # (or fails the deployment) here exactly as in the server.
        return LoopThreadClient(self.config)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without ``sampling_params``: the checkpoint's recommended
        values (``generation_config``, as vLLM), else SamplingParams' own defaults."""
        defaults: dict[str, Any] = dict(self.config.model.sampling_defaults)
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Raises ValueError for bad input, and
        ``tidal.protocol.errors.RequestFailedError`` (with the engine's message) if the
        engine refuses or fails a request; the other requests are then aborted."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down; create a new one")
        batch: Sequence[PromptType]
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            batch = [typing.cast(PromptType, prompts)]  # one prompt (text, dict or token ids)
        else:
            batch = typing.cast(Sequence[PromptType], prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _broadcast_params(sampling_params, len(batch))
        processed = [self.input_processor.tokenize(p) for p in batch]
        for prompt, sp in zip(processed, params):
            self.input_processor.check(prompt, sp)
        order: list[str] = []
        try:
            for prompt, sp in zip(processed, params):
                order.append(self._add(prompt, sp))
        except BaseException:  # e.g. Ctrl-C: what was sent must not keep the engines busy
            self._abort(order)
            raise
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        conversations = typing.cast(
            list[list[dict[str, Any]]],
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        prompts: list[PromptType] = []
        for conv in conversations:
            p = self.input_processor.apply_chat_template(conv, add_generation_prompt, chat_template)
            prompts.append({"prompt": p.prompt, "prompt_token_ids": p.prompt_token_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, prompt: Any, params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        children = self.output_processor.add_request(
            request_id, prompt.prompt, prompt.prompt_token_ids, params, OutputKind.FINAL_ONLY
        )
        try:
            for req in self.input_processor.make_requests(children, prompt, params):
                self.client.add_request(req)
        except BaseException:
            # Interrupted between two children (Ctrl-C): the ones sent must not run on,
            # and the request must not stay unfinished here, or the next generate()
            # would wait for it forever. The caller aborts the requests added before.
            self._abort([request_id])
            raise
        return request_id

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.output_processor.has_unfinished():
                outs = self.client.get_output()
                processed = self.output_processor.process_outputs(outs.outputs)
                if processed.reqs_to_abort:
                    self.client.abort_requests(processed.reqs_to_abort)
                if processed.failed:
                    raise processed.failed[0]  # the others are aborted below
                for ro in processed.request_outputs:
                    if ro.finished:
                        finished[ro.request_id] = ro
                        bar.update(1)
        except BaseException:
            self._abort(order)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in order]

    def sleep(self, level: int = 1) -> int:
        """vLLM's ``LLM.sleep``: free every rank's KV cache between ``generate`` calls,
        and at level 2 the weights too (docs/operations.md#sleep-mode). Returns the bytes
        freed; ``generate`` fails until ``wake_up()``."""
        return sum(self._call_all("sleep", level))

    def wake_up(self) -> None:
        """Make the KV caches again (after level 2, reload the weights from the
        checkpoint first); outputs are as before the sleep."""
        self._call_all("wake_up")

    def cpu_kernels(self) -> list[dict[str, Any] | None]:
        """Each rank's measured CPU kernel paths, as ``/stats`` shows them (``cpu_kernels``):
        per op the decode and batch paths, where the choice came from and the trial's
        timings; None for a rank without CPU paths."""
        return self._call_all("get_cpu_kernels")

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        every = getattr(self.client, "call_utility_all", None)  # one call per rank
        return every(method, *args) if every else [self.client.call_utility(method, *args)]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.client.abort_requests(self.output_processor.abort(rid))

    def shutdown(self) -> None:
        """Stop the engines and release their resources. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def runs_in_process(config: EngineConfig) -> bool:
    """Where ``LLM(multiprocess=None)`` runs the engine core: in the caller's process when it
    is one CPU rank. Such a rank gives its OpenMP threads every core (``Worker``), so a
    frontend process beside it can only run by preempting one of them, and the step's whole
    parallel region waits for that thread: on the 2-core CI machine the separate process cost
    7-15% of decode throughput. In-process, output processing runs between steps
    instead of against them. A GPU rank keeps its process: there the frontend's work overlaps
    the device's. ``multiprocess=True`` asks for the process anyway (crash isolation)."""
    return config.device == "cpu" and not config.parallel.is_data_parallel


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams], n: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
