"""The worker lives in the engine process (the default for DP ranks)."""

from __future__ import annotations

from typing import Any

from tidal.config import EngineConfig
from tidal.executor.base import Executor
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
        self.worker = Worker(config, local_rank=config.parallel.data_parallel_rank)
        try:
            if joining:
                if topology is None or engine_id is None:
                    raise ValueError("a joining engine needs its topology and engine id")
                self.worker.init_joiner(topology, engine_id)
                return
            # Groups first: with expert parallelism the placement decides what to load.
            self.worker.init_distributed(topology, engine_id)
            self.worker.load_model(local_expert_ids)
        except Exception:
            self.worker.shutdown()
            raise

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]
