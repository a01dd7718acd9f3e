"""The engine client's migrator (docs/architecture.md#elastic-migration): requests resumed
off an engine that left or died, and the request book that makes it possible.

``Migrator`` owns the ``RequestBook`` (rank recovery / elastic EP: every engine request
sent, its owner and its outputs so far; None without reconfiguration, when the migrator
does nothing). The router records each routed ADD in that book; the migrator filters
outputs by ownership (an engine that no longer owns a request is not heard for it),
hands a departed engine's requests to others through the router, and puts the outputs it
makes itself (finishes, errors) on the client's queue through ``deliver``. Called on the
event loop's thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import zmq

from tidal.elastic.migration import AlreadyFinished
from tidal.frontend.request_book import RequestBook
from tidal.frontend.router import Router, encode_request
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType

logger = logging.getLogger(__name__)


class Migrator:
    """Moves requests between engines. State: the request book (or None)."""

    def __init__(
        self,
        book: RequestBook | None,
        router: Router,
        deliver: Callable[[EngineCoreOutputs], None],
    ) -> None:
        self.book = book
        self.router = router
        self.deliver = deliver  # outputs made here, to the caller's queue

    def accept(self, outs: EngineCoreOutputs) -> None:
        """Drop the outputs of ``outs`` whose request that engine does not own."""
        if self.book is not None and outs.outputs:
            outs.outputs = self.book.accept(outs.engine_id, outs.outputs)

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests end (aborted): they leave the book, so no migration revives them."""
        if self.book is not None:
            for rid in request_ids:
                self.book.finish(rid)

    def set_epoch(self, epoch: int) -> None:
        """Ownership moves to the topology of ``epoch``."""
        if self.book is not None:
            self.book.set_epoch(epoch)

    def migrate(self, engine_id: int, request_ids: Iterable[str] | None = None) -> int:
        """Resume requests of ``engine_id`` on other engines: those named (it handed them
        back) or, with None, every one it still owns (it is gone). Each is sent as a
        resumed request (prompt + outputs so far) to an engine the balancer picks, never a
        draining one nor a former owner; one whose outputs already end it gets its finish
        delivered instead. Returns how many were moved or finished (a request that cannot
        be moved gets an ERROR finish and is not counted)."""
        book, dp = self.book, self.router.dp
        if book is None or dp is None:
            return 0
        moved = 0
        finishes: list[EngineCoreOutput] = []
        for item in book.take(engine_id, request_ids):
            rid = item.request_id
            if isinstance(item, AlreadyFinished):
                finishes.append(book.finished_output(item))
                dp.finished(rid)
                moved += 1
                continue
            request = item.to_engine_request(current_wave=0)  # routing stamps the wave
            try:
                exclude = book.blocked_targets(rid, dp.topology.engine_ids)
                exclude.add(engine_id)
                target, wake = self.router.reroute(request, exclude=exclude)
            except (RuntimeError, ValueError) as e:
                dp.finished(rid)
                finishes.append(book.failed_output(rid, f"request could not be moved: {e}"))
                continue
            try:
                book.moved(item, target, old_owner_stopped=True)
                payload = encode_request(request)
                self.router.transport.send(target, EngineCoreRequestType.ADD, payload)
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 - one request fails, not the client
                if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH:
                    # The target is gone too (its exit is on its way): the request stays
                    # in its name, and that death moves it again -- or, with nobody left,
                    # the client's failure ends it.
                    logger.warning("request %s: engine %d is gone as well", rid, target)
                    moved += 1
                    continue
                logger.warning("request %s could not be moved to engine %d: %s", rid, target, e)
                dp.unroute(rid, target, wake)
                finishes.append(book.failed_output(rid, f"request could not be moved: {e}"))
                continue
            if wake is not None:
                self.router.send_wakeup(wake)
            moved += 1
        if finishes:
            self.deliver(EngineCoreOutputs(engine_id=engine_id, outputs=finishes))
        return moved
