"""EngineCore: one DP rank's brain. schedule -> execute -> update, nothing else.

No sockets and no threads here: ``EngineCoreProc`` (proc.py) wraps it with I/O, and the
in-process client calls it directly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tidal.config import EngineConfig
from tidal.engine_core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.executor.base import Executor
from tidal.executor.uniproc import UniProcExecutor
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
    ) -> None:
        t0 = time.monotonic()
        self.config = config
        self.executor = executor or UniProcExecutor(config)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks)
        self.vocab_size = int(config.model.hf_config.vocab_size)
        logger.info(
            "engine core ready in %.2fs: %d KV blocks of %d tokens",
            time.monotonic() - t0,
            self.num_blocks,
            config.cache.block_size,
        )

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue. Raises ValueError with a user-facing message."""
        self.scheduler.add_request(self.make_request(req))

    def make_request(self, req: EngineCoreRequest) -> Request:
        params = SamplingParams(**_struct_fields(req.sampling_params))
        validate_prompt(req.prompt_token_ids, self.config.model.max_model_len, self.vocab_size)
        return Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=params,
            eos_token_id=req.eos_token_id,
            client_index=req.client_index,
            arrival_time=req.arrival_time or None,
            max_model_len=self.config.model.max_model_len,
            current_wave=req.current_wave,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    # ---- stepping ----------------------------------------------------------------------

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One schedule -> execute -> update. Returns outputs per client index and whether
        the model ran (a rank with nothing scheduled returns ({}, False))."""
        # has_requests also covers finished-but-unreported requests (abort notices).
        if not self.scheduler.has_requests():
            return {}, False
        sched = self.scheduler.schedule()
        runner_out = self.executor.execute_model(sched)
        outputs = self.scheduler.update_from_output(sched, runner_out)
        return outputs, sched.total_num_scheduled_tokens > 0

    def execute_dummy_batch(self) -> None:
        self.executor.execute_dummy_batch()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- utility methods (callable by name from clients) -------------------------------

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        self.scheduler.reset_prefix_cache()
        return True

    def get_expert_load(self) -> dict[int, list[int]]:
        """Per layer, tokens routed to each logical expert over the EPLB window (this rank)."""
        return self.executor.get_expert_load()

    def get_eplb_info(self) -> dict[str, Any]:
        """Rebalances so far and the current physical -> logical expert layout per layer."""
        eplb = self.executor.worker.model_runner.eplb
        if eplb is None:
            return {"num_rebalances": 0, "layouts": {}}
        layouts = {
            str(lid): list(p.physical_to_logical) for lid, p in zip(eplb.layer_ids, eplb.placements)
        }
        return {"num_rebalances": eplb.num_rebalances, "layouts": layouts}

    def get_num_blocks(self) -> int:
        return self.num_blocks

    def echo(self, value: Any) -> Any:
        return value

    def shutdown(self) -> None:
        self.executor.shutdown()


def validate_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt must not be empty")
    if n >= max_model_len:
        raise ValueError(
            f"prompt is {n} tokens, which leaves no room to generate within the model's "
            f"maximum context length of {max_model_len} tokens"
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range for vocab size {vocab_size}")


def _struct_fields(s: Any) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}
