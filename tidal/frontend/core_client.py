"""The blocking engine interface of the offline ``LLM``, and its in-process fast path.

- ``InprocClient`` (here): the EngineCore lives in the caller's process (one CPU rank:
  ``tidal.launch.llm.runs_in_process``; tests, debugging).
- ``LoopThreadClient`` (``loop_client``): engines in processes; the one engine client,
  ``AsyncMPClient`` (``async_client``), run on a loop thread -- the
  same client the API server's ``AsyncLLM`` runs on its own loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tidal.config import EngineConfig
from tidal.engine_core.core import EngineCore
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """What the offline ``LLM`` needs from an engine, however it is hosted."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until some are available or the engine dies)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """Steps the engine core in the calling thread: get_output() is one step."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine.step()
        merged = EngineCoreOutputs(outputs=[])
        for o in outputs.values():
            merged.outputs.extend(o.outputs)
            merged.scheduler_stats = o.scheduler_stats
        return merged

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def shutdown(self) -> None:
        self.engine.shutdown()
