"""One rank's device: pin threads or the GPU, load weights, allocate the KV cache."""

from __future__ import annotations

import os

import torch

from tidal.config import EngineConfig
from tidal.engine_core.batch import ModelRunnerOutput, SchedulerOutput
from tidal.executor.model_runner import ModelRunner


def cpu_threads_for_rank(num_local_ranks: int) -> int:
    """Each rank on a node takes an equal share of the cores (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, num_local_ranks))


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0) -> None:
        self.config = config
        self.local_rank = local_rank
        self.device = self._init_device()
        torch.manual_seed(config.model.seed)
        self.model_runner = ModelRunner(config, self.device)

    def _init_device(self) -> torch.device:
        if self.config.device == "cuda":
            device = torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
            return device
        torch.set_num_threads(cpu_threads_for_rank(self.config.parallel.data_parallel_size_local))
        return torch.device("cpu")

    def load_model(self, local_expert_ids: list[int] | None = None) -> None:
        self.model_runner.load_model(local_expert_ids)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)

    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        self.model_runner.execute_dummy_batch(num_tokens)
