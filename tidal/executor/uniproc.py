"""The worker lives in the engine process (the default for DP ranks)."""

from __future__ import annotations

from typing import Any

from tidal.config import EngineConfig
from tidal.executor.base import Executor
from tidal.executor.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, local_expert_ids: list[int] | None = None) -> None:
        super().__init__(config)
        self.worker = Worker(config, local_rank=config.parallel.data_parallel_rank)
        self.worker.load_model(local_expert_ids)

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]
