"""Tensor parallelism inside one rank (docs/architecture.md#tensor-parallel): a worker's place in its rank's TP group
and the collectives the sharded layers use.

Sharding (Megatron's scheme, the same as vLLM's):

- column-parallel (QKV, gate/up, the lm_head): each worker holds a contiguous block of
  output rows and computes its block; nothing to reduce, the next layer consumes it;
- row-parallel (O, down): each worker holds the matching block of input columns; the
  partial products are summed over the group (``all_reduce``), then the bias is added;
- vocab-parallel (embedding, lm_head): worker t holds vocabulary rows
  ``[t * ceil(V/N), ...)``, the last block padded; the embedding looks up its own ids and
  zeroes the rest before the all-reduce; the lm_head's logit blocks are gathered on the
  driver (TP rank 0), the only worker that samples;
- attention: heads and KV heads divide over the workers, each keeps the KV cache of its
  own heads; Q/K norms are per head and apply to the local heads unchanged;
- MoE without EP: every worker holds every expert's slice of the intermediate dimension
  (a column-parallel gate/up and a row-parallel down per expert); with EP the EP group is
  DP x TP and each worker routes and dispatches only its share of the step's tokens
  (``row_shares``), then the group all-gathers the results: no TP-fold repeated work.

Group tensors live on the group's device (gloo: CPU, NCCL: the worker's GPU), the same
device as the model's. With ``size == 1`` every collective is the identity and no layer
pays for any of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class TensorParallel:
    """One object per worker, shared by all its layers: when the rank rebuilds its TP
    group (after a peer rank's death left a collective half done, ``Worker``), replacing
    ``group`` here reaches every layer."""

    rank: int = 0
    size: int = 1
    # A StatelessGroup over the rank's workers (tidal/distributed/groups.py); None at size 1.
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TP place: rank {self.rank} of {self.size}")

    @property
    def is_driver(self) -> bool:
        """TP rank 0: samples, and answers the engine."""
        return self.rank == 0

    def split(self, n: int, what: str) -> int:
        """``n // size``, or a ValueError naming ``what`` when it does not divide."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({self.size})")
        return n // self.size

    def vocab_shard(self, vocab: int) -> tuple[int, int, int]:
        """``(start, valid, padded)``: this worker's first vocabulary row, how many real
        rows it holds, and the padded block every worker allocates (``ceil(V / N)``)."""
        padded = -(-vocab // self.size)
        start = self.rank * padded
        return start, max(0, min(vocab, start + padded) - start), padded

    def row_shares(self, num_rows: int) -> list[int]:
        """Rows of a ``num_rows`` batch each worker takes (contiguous blocks, in rank
        order, ``ceil(n / N)`` each but the last ones; 0 when rows run out)."""
        q = -(-num_rows // self.size)
        return [max(0, min(num_rows, (t + 1) * q) - t * q) for t in range(self.size)]

    def all_reduce(self, x: Tensor) -> Tensor:  # sum over the group, in place
        if self.size == 1:
            return x
        return self.group.all_reduce(x)

    def all_gather_rows(self, x: Tensor, sizes: list[int]) -> Tensor:
        """``[sizes[rank], ...]`` here -> ``[sum(sizes), ...]``, rank blocks in order."""
        if self.size == 1:
            return x
        return self.group.all_gather_v(x, sizes)

    def gather_cols(self, x: Tensor) -> Tensor | None:
        """``[N, C]`` here -> ``[N, size * C]`` (rank blocks in order) on the driver;
        None elsewhere."""
        if self.size == 1:
            return x
        parts = self.group.gather(x, 0)
        return None if parts is None else torch.cat(parts, dim=1)
