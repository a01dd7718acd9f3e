"""Executor ABC: how an engine core reaches its worker(s).

The engine core calls only these methods, never a worker directly (DESIGN.md 1), so an
executor whose workers live in other processes (TP > 1) is a drop-in replacement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tidal.config import EngineConfig
from tidal.executor.batch import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """Call ``method`` on every worker; one result per worker."""

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (sched,))[0]

    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        self.collective_rpc("execute_dummy_batch", (num_tokens,))

    def all_reduce_dp(self, values: list[int]) -> list[int]:
        """Sum ``values`` over the DP ranks (the busy loop's wave consensus): a collective,
        every rank calls it at the same step. One rank (no DP group): ``values``."""
        return self.collective_rpc("all_reduce_dp", (values,))[0]

    def get_expert_load(self) -> dict[int, list[int]]:
        """Per-layer expert load over the EPLB window, counted on this engine's rank(s)."""
        return self.collective_rpc("get_expert_load")[0]

    def get_eplb_info(self) -> dict[str, Any]:
        """EPLB rebalances so far and each MoE layer's physical -> logical expert layout."""
        return self.collective_rpc("get_eplb_info")[0]

    def shutdown(self) -> None:
        """Release the workers' process groups (each worker's ``shutdown``)."""
        self.collective_rpc("shutdown")
