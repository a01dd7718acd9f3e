"""The worker lives in the engine process (the default for DP ranks)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tidal.config import EngineConfig
from tidal.executor.base import Executor
from tidal.executor.rpc import Rpc
from tidal.executor.worker import Worker
from tidal.protocol.topology import Topology


class UniProcExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        local_expert_ids: list[int] | None = None,
        *,
        topology: Topology | None = None,
        engine_id: int | None = None,
        joining: bool = False,
    ) -> None:
        """``topology``/``engine_id``: the DP group this engine joins and its place there
        (see ``Worker.init_distributed``); None: the launch topology of ``config``.
        ``joining``: an elastic EP joiner (``Worker.init_joiner``): no group yet."""
        super().__init__(config)
        p = config.parallel
        if p.tensor_parallel_size != 1:
            raise ValueError("UniProcExecutor runs one worker: tensor_parallel_size must be 1")
        self.worker = Worker(
            config,
            local_rank=p.data_parallel_rank,
            device_index=p.device_ids[0] if p.device_ids else 0,
        )
        self.worker.start(topology, engine_id, joining, local_expert_ids)
        self._targets = self.worker.rpc_targets()

    def _run(self, rpc: Rpc, args: tuple[Any, ...]) -> list[Any]:
        return [self.worker.serve(rpc, getattr(self._targets[rpc.namespace], rpc.name), args)]

    def worker_pids(self) -> list[int]:
        return [os.getpid()]

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """The worker is this process: it cannot die on its own."""

    def shutdown(self) -> None:
        self.worker.shutdown()
