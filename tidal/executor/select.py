"""Which ``Executor`` a rank runs: its workers in the engine's process (TP size 1) or in
processes of their own (``MultiprocExecutor``, docs/architecture.md#tensor-parallel). The engine core names neither:
it asks ``create_executor`` and talks to the ``Executor`` interface."""

from __future__ import annotations

from tidal.config import EngineConfig
from tidal.executor.base import Executor
from tidal.executor.multiproc import MultiprocExecutor
from tidal.executor.uniproc import UniProcExecutor
from tidal.protocol.topology import Topology


def create_executor(
    config: EngineConfig,
    *,
    topology: Topology | None = None,
    engine_id: int | None = None,
    joining: bool = False,
) -> Executor:
    """The rank's executor, its workers started and placed (``topology``/``engine_id``:
    its DP group and its place there, None: the launch topology of ``config``;
    ``joining``: an elastic EP joiner, in no group yet)."""
    kw = {"topology": topology, "engine_id": engine_id, "joining": joining}
    if config.parallel.tensor_parallel_size > 1:
        return MultiprocExecutor(config, **kw)
    return UniProcExecutor(config, **kw)
