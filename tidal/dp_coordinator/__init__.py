"""DP coordinator (wave protocol, load snapshots) and the frontend's load balancer.

``state`` and ``balance`` are pure; ``proc`` is the socket process. Importing the package
does not import zmq: take the process API from ``tidal.dp_coordinator.handle``.
"""

from tidal.dp_coordinator.balance import Balancer, check_rank, choose_engine, policy_names
from tidal.dp_coordinator.state import (
    BroadcastStartWave,
    CoordinatorState,
    PublishSnapshot,
)

__all__ = [
    "Balancer",
    "BroadcastStartWave",
    "CoordinatorState",
    "PublishSnapshot",
    "check_rank",
    "choose_engine",
    "policy_names",
]
