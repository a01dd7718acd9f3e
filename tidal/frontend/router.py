"""The engine client's router (docs/architecture.md#frontend-client): which engine gets each
request, and the frontend's half of the DP wave protocol.

``Router`` owns the DP state (``DPFrontendState``: balancer, wave, which engine holds
which request; None below DP 2 without elastic EP, when every request goes to the one
engine), the engines that are gone (exited or declared dead, not yet removed by a
recovery: routed nothing more), pinned ranks (``data_parallel_rank``) and the draining
(excluded) engines. It sends through the transport and records every routed ADD in the
request book it is given (rank recovery / elastic EP). How a wake-up reaches the ranks
depends on the coordinator's health, which the liveness monitor knows: ``wake_route``.
Called on the event loop's thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import assert_never

import msgspec
import zmq

from tidal.frontend.dp_state import DPFrontendState
from tidal.frontend.liveness import WakeRoute
from tidal.frontend.request_book import RequestBook
from tidal.frontend.transport import EngineTransport
from tidal.protocol.errors import RankUnavailableError
from tidal.protocol.messages import (
    SNAPSHOT_DECODER,
    DPSetTopology,
    DPWakeUp,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    StartDPWave,
    encode,
)
from tidal.protocol.topology import Topology

logger = logging.getLogger(__name__)


def encode_request(request: EngineCoreRequest) -> bytes:
    """msgpack of an ADD; ``ValueError`` (the caller's error) for a value the wire cannot
    carry."""
    try:
        return encode(request)
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        # A value the wire cannot carry (e.g. an int beyond 64 bits): the caller's error.
        raise ValueError(f"request {request.request_id!r} cannot be sent to the engine: {e}") from e


def pinned_gone(rank: int | None, engine: int) -> str:
    return (
        f"data_parallel_rank {rank}: its engine ({engine}) is dead and the deployment "
        "is recovering without it; retry without data_parallel_rank, or with another rank"
    )


class Router:
    """Engine choice and the wave. State: ``dp`` (None without the DP machinery), the
    launch topology, ``gone`` engines; shares the request book with the migrator."""

    def __init__(
        self,
        transport: EngineTransport,
        launch_topology: Topology,
        dp: DPFrontendState | None,
        book: RequestBook | None,
        wake_route: Callable[[], WakeRoute] = lambda: WakeRoute.COORDINATOR,
    ) -> None:
        self.transport = transport
        self.dp = dp
        self._launch_topology = launch_topology
        self._book = book
        # Engines that exited (or were declared dead) and that a recovery removes: no
        # request goes there any more (the scale driver took them over).
        self.gone: set[int] = set()
        self.wake_route = wake_route  # the liveness monitor's, once it exists

    @property
    def topology(self) -> Topology:
        """The live deployment: the DP state's (it follows reconfigurations), else the
        launch one."""
        return self.dp.topology if self.dp is not None else self._launch_topology

    @property
    def engine_ids(self) -> list[int]:
        """The engines requests can go to, in rank order."""
        return self.topology.engine_ids

    def live_engine_ids(self) -> list[int]:
        """The members not known to be gone (they can answer)."""
        return [e for e in self.engine_ids if e not in self.gone]

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Route and send an ADD (see ``AsyncMPClient.add_request``)."""
        if self.dp is None:
            payload = encode_request(request)
            self.transport.send(self.engine_ids[0], EngineCoreRequestType.ADD, payload)
            return
        if not self.check_pinned_rank(request.data_parallel_rank):
            request.data_parallel_rank = None
        unreachable: set[int] = set()
        while True:
            rank, wake = self.dp.route(request, exclude=unreachable)  # stamps the wave
            try:
                self._send_routed(request, rank)
            except zmq.ZMQError as e:
                self.dp.unroute(request.request_id, rank, wake)
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                if request.data_parallel_rank is not None:
                    raise RankUnavailableError(
                        pinned_gone(request.data_parallel_rank, rank)
                    ) from None
                logger.warning("engine %d is unreachable (gone?): request rerouted", rank)
                unreachable.add(rank)
                continue
            except BaseException:
                self.dp.unroute(request.request_id, rank, wake)
                raise
            break
        if wake is not None:
            # Only now that the ADD is out: the ranks this wakes wait in a collective for
            # the one holding the request, so it must be certain to get it.
            self.send_wakeup(wake)

    def _send_routed(self, request: EngineCoreRequest, engine_id: int) -> None:
        """Record (request book) and send one routed ADD; nothing stays recorded if the
        send fails."""
        if self._book is not None:
            self._book.add(request, engine_id)
        try:
            self.transport.send(engine_id, EngineCoreRequestType.ADD, encode_request(request))
        except BaseException:
            if self._book is not None:
                self._book.finish(request.request_id)
            raise

    def check_pinned_rank(self, rank: int | None) -> bool:
        """Whether a request pinned to DP rank ``rank`` can go there: raises
        ``RankUnavailableError`` when its engine is dead (the deployment recovers without
        it); False when it leaves (a scale-down drains it: the request goes where the
        balancer sends it, as that rank's own requests do); True otherwise (or unpinned).
        A rank outside the topology is the balancer's to refuse."""
        if rank is None or self.dp is None:
            return True
        ids = self.dp.topology.engine_ids
        if not 0 <= rank < len(ids):
            return True
        engine = ids[rank]
        if engine in self.gone:
            raise RankUnavailableError(pinned_gone(rank, engine))
        return engine not in self.dp.draining

    def reroute(
        self, request: EngineCoreRequest, *, exclude: Collection[int]
    ) -> tuple[int, DPWakeUp | None]:
        """A migrating request's new engine (never an excluded or draining one) and the
        wake-up to send after it; ``RuntimeError`` / ``ValueError`` when none can take it."""
        assert self.dp is not None  # migration needs the DP machinery
        return self.dp.reroute(request, exclude=exclude)

    def send_wakeup(self, wake: DPWakeUp) -> None:
        """To the coordinator, which starts the other ranks. While it is down or just
        restarted (docs/architecture.md#faults: its sockets may not have reconnected yet)
        the frontend also plays its part: START_DP_WAVE straight to every other member,
        what the coordinator broadcasts for a wake-up. A duplicate START is harmless
        (engines ignore it for a wave they run or ended), a lost one strands a rank
        alone."""
        route = self.wake_route()
        match route:
            case WakeRoute.COORDINATOR:
                self.transport.send_upstream(encode(wake))
                return
            case WakeRoute.COORDINATOR_AND_DIRECT:
                self.transport.send_upstream(encode(wake))
            case WakeRoute.DIRECT:
                pass
            case _:
                assert_never(route)
        start = encode(StartDPWave(wake.wave, wake.engine_id))
        for e in self.engine_ids:
            if e == wake.engine_id:
                continue
            try:
                self.transport.send(e, EngineCoreRequestType.START_DP_WAVE, start)
            except zmq.ZMQError:
                pass  # no route to it (gone): nothing to wake

    def abort(self, request_ids: list[str]) -> None:
        """ABORT each request on the engine holding it (already out of the book)."""
        if self.dp is None:
            self._send_abort(self.engine_ids[0], request_ids)
            return
        for rank, ids in self.dp.on_abort(request_ids).items():
            self._send_abort(rank, ids)

    def _send_abort(self, engine: int, request_ids: list[str]) -> None:
        if not self.transport.try_send(engine, EngineCoreRequestType.ABORT, encode(request_ids)):
            # The engine is gone (its death is on its way to the liveness check): nothing
            # runs there to abort, and the book already keeps these requests out of its
            # migration. Raising would fail every stream from the output handler.
            logger.info("abort of %d request(s): engine %d is gone", len(request_ids), engine)

    # ------------------------------------------------------------------ what comes back

    def on_outputs(self, outs: EngineCoreOutputs) -> None:
        """Finished requests leave the balancer's in-flight counts."""
        if self.dp is not None:
            self.dp.on_outputs(outs)

    def on_snapshot(self, frame: bytes) -> None:
        """A load snapshot of the coordinator (``msgspec.DecodeError`` when garbled)."""
        assert self.dp is not None  # snapshots are subscribed to only with DP state
        self.dp.on_snapshot(SNAPSHOT_DECODER.decode(frame))

    # ------------------------------------------------------------------ reconfiguration

    def set_topology(self, topology: Topology) -> Topology:
        """Tell the coordinator (``DPSetTopology``), route by ``topology`` (balancer, wave
        state: the next request wakes the engines); the topology now routed by (it keeps
        the draining engines that are still members)."""
        if self.dp is None:
            raise RuntimeError("set_topology needs the DP machinery (elastic EP)")
        self.transport.send_upstream(encode(DPSetTopology(topology)))
        self.dp.set_topology(topology)
        return self.dp.topology

    def exclude(self, engine_ids: Iterable[int]) -> None:
        """These engines get no automatically routed request (leaving in a scale-down):
        the balancer's draining set."""
        if self.dp is not None:
            self.dp.set_draining(self.dp.draining | set(engine_ids))

    def restore(self, engine_ids: Iterable[int]) -> None:
        if self.dp is not None:
            self.dp.set_draining(self.dp.draining - set(engine_ids))
