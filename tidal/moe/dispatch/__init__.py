"""Expert-parallel token dispatchers (``--all2all-backend``): move tokens to the ranks that
own their experts, and the expert outputs back.

The contract every backend keeps is ``base.Dispatcher``'s; the backends are ``collective``
(``allgather_reducescatter``, ``all2all``) and ``deepep`` (``deepep_high_throughput``,
``deepep_low_latency``). This module is their registry.
"""

from __future__ import annotations

from typing import Any

from tidal.moe.dispatch.base import Dispatcher
from tidal.moe.dispatch.collective import AllGatherReduceScatterDispatcher, AllToAllDispatcher
from tidal.moe.dispatch.deepep import DeepEPHighThroughputDispatcher, DeepEPLowLatencyDispatcher
from tidal.moe.placement import ExpertPlacement

DISPATCHERS: dict[str, type[Dispatcher]] = {
    cls.name: cls
    for cls in (
        AllGatherReduceScatterDispatcher,
        AllToAllDispatcher,
        DeepEPHighThroughputDispatcher,
        DeepEPLowLatencyDispatcher,
    )
}


def get_dispatcher(name: str, group: Any, placement: ExpertPlacement, **options: Any) -> Dispatcher:
    """The dispatcher for ``--all2all-backend name`` on ``group`` (a ``StatelessGroup``, or
    None for a single rank). ``options``: ``hidden_size`` (DeepEP), ``max_tokens_per_rank``
    (DeepEP low-latency); ignored by the others."""
    if name not in DISPATCHERS:
        raise ValueError(f"all2all backend must be one of {', '.join(DISPATCHERS)}; got {name!r}")
    cls = DISPATCHERS[name]
    if cls in (AllGatherReduceScatterDispatcher, AllToAllDispatcher):
        return cls(group, placement)
    return cls(group, placement, **options)
