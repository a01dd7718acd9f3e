"""Batch -> tensors -> forward -> sample, for one rank.

The runner turns a ``SchedulerOutput`` into flattened inputs (no padding: prefills and
decodes share one batch), runs the model, and samples one token for every request whose
chunk reached its last known token. It owns the KV cache tensors and per-request
sampling state (seeded generators), nothing else: the scheduler owns progress.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.config import EngineConfig
from tidal.engine_core.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tidal.engine_core.kv_cache import NULL_BLOCK_ID
from tidal.engine_core.messages import Logprobs
from tidal.layers.attention import AttentionMetadata, kv_cache_shape
from tidal.layers.sampler import RowInfo, Sampler, SamplingMetadata, compute_logprobs
from tidal.models.loader import load_model


@dataclass
class _Inputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: list[int]  # flattened row of the last token of each sampling request
    sample_reqs: list[ScheduledRequest]
    prompt_lp: list[tuple[ScheduledRequest, int, int]]  # (req, first row, count)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache.block_size
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    # ---- setup -------------------------------------------------------------------------

    def load_model(self, local_expert_ids: list[int] | None = None) -> None:
        self.model = load_model(self.config, local_expert_ids=local_expert_ids)

    def kv_bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec()
        shape = kv_cache_shape(1, self.block_size, num_kv_heads, head_dim)
        elem = torch.tensor([], dtype=self.config.model.torch_dtype).element_size()
        return num_layers * elem * _prod(shape)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the configured KV budget, capped at what max_num_seqs full-length
        sequences could ever use (no point allocating more)."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        else:
            per_seq = -(-sched.max_model_len // self.block_size)
            num_blocks = min(
                cache.kv_cache_memory_bytes // self.kv_bytes_per_block(),
                sched.max_num_seqs * per_seq + 1,
            )
        if num_blocks * self.block_size < sched.max_model_len:
            raise ValueError(
                f"KV cache of {num_blocks} blocks x {self.block_size} tokens cannot hold one "
                f"sequence of max_model_len={sched.max_model_len}; lower max_model_len or raise "
                "kv_cache_memory_bytes / num_gpu_blocks_override"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec()
        shape = kv_cache_shape(num_blocks, self.block_size, num_kv_heads, head_dim)
        dtype = self.config.model.torch_dtype
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.model.bind_kv_cache(self.kv_caches)

    # ---- step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids:
            self._generators.pop(req_id, None)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        inputs = self._prepare_inputs(sched.scheduled)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn)  # [T, H]
        if inputs.sample_reqs:
            self._sample(hidden, inputs, out)
        if inputs.prompt_lp:
            self._prompt_logprobs(hidden, inputs, out)
        return out

    @torch.inference_mode()
    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        """A forward over dummy tokens that writes no KV: keeps collectives of idle ranks
        matched with busy ones (data parallel + expert parallel)."""
        # Dummy KV goes to the reserved null block, which no request ever reads.
        blocks = [NULL_BLOCK_ID] * -(-num_tokens // self.block_size)
        attn = AttentionMetadata.build([(0, num_tokens, blocks)], self.block_size, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, dtype=torch.long, device=self.device)
        self.model(ids, pos, attn)

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]) -> _Inputs:
        ids: list[int] = []
        pos: list[int] = []
        seqs: list[tuple[int, int, list[int]]] = []
        sample_rows: list[int] = []
        sample_reqs: list[ScheduledRequest] = []
        prompt_lp: list[tuple[ScheduledRequest, int, int]] = []
        for sr in scheduled:
            req, start, n = sr.request, sr.start, sr.num_new_tokens
            row0 = len(ids)
            ids.extend(req.all_token_ids[start : start + n])
            pos.extend(range(start, start + n))
            seqs.append((start, n, req.block_ids))
            if sr.samples:
                sample_rows.append(row0 + n - 1)
                sample_reqs.append(sr)
            if req.sampling_params.prompt_logprobs is not None:
                # Rows whose next token is still a prompt token get a prompt logprob.
                count = min(start + n, req.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_lp.append((sr, row0, count))
        dev = self.device
        return _Inputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            attn=AttentionMetadata.build(seqs, self.block_size, dev),
            sample_rows=sample_rows,
            sample_reqs=sample_reqs,
            prompt_lp=prompt_lp,
        )

    def _sample(self, hidden: torch.Tensor, inputs: _Inputs, out: ModelRunnerOutput) -> None:
        rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [N, V] float32
        infos = [self._row_info(sr) for sr in inputs.sample_reqs]
        result = self.sampler(logits, SamplingMetadata.build(infos, logits.device))
        tokens = result.token_ids.tolist()
        for sr, tok, lp in zip(inputs.sample_reqs, tokens, result.logprobs):
            rid = sr.request.request_id
            out.sampled_token_ids[rid] = [tok]
            if lp is not None:
                out.logprobs[rid] = [lp]

    def _row_info(self, sr: ScheduledRequest) -> RowInfo:
        req = sr.request
        params = req.sampling_params
        gen = None
        if params.seed is not None and not params.greedy:
            gen = self._generators.get(req.request_id)
            if gen is None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed)
                self._generators[req.request_id] = gen
        return RowInfo(
            params=params,
            generator=gen,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            eos_token_id=req.eos_token_id,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, inputs: _Inputs, out: ModelRunnerOutput
    ) -> None:
        for sr, row0, count in inputs.prompt_lp:
            req = sr.request
            logits = self.model.compute_logits(hidden[row0 : row0 + count])  # [count, V]
            nxt = req.prompt_token_ids[sr.start + 1 : sr.start + 1 + count]
            targets = torch.tensor(nxt, dtype=torch.long, device=logits.device)
            k = req.sampling_params.prompt_logprobs
            lps: list[Logprobs] = compute_logprobs(logits, targets, [k] * count)
            out.prompt_logprobs[req.request_id] = lps


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
