"""ScaleDriver: the asyncio shell around the ScaleController, against a fake client and a
fake process manager that record every call; the test plays the engines (ScaleReports,
exits). No processes, no sockets."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

import pytest

from tidal.elastic.plan import ScalePlanError
from tidal.frontend.launchers.proc_manager import EngineStartError
from tidal.frontend.scaling.scale_controller import ScaleController
from tidal.frontend.scaling.scale_driver import ScaleDriver
from tidal.frontend.scaling.scale_records import Admission, ScaleTimeouts
from tidal.protocol.elastic import (
    ScaleAbort,
    ScaleCommit,
    ScaleEvent,
    ScaleMessage,
    ScalePrepare,
    ScaleReport,
)
from tidal.protocol.topology import Topology

pytestmark = pytest.mark.timeout(60)

T = ScaleTimeouts(
    start_engines_s=30,
    prepare_s=40,
    commit_s=10,
    finish_s=5,
    rendezvous_s=10,
    transfer_s=20,
    engine_commit_s=5,
)


class FakeClient:
    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.calls: list[tuple] = []
        self.excluded: set[int] = set()
        self.dead_reason: str | None = None
        self.started = 0
        self.migrate_counts: dict[int, int] = {}
        self.failed_moves: list[int] = []  # engines whose requests found no target

    def start(self) -> None:
        self.started += 1

    def set_topology(self, topology: Topology) -> None:
        self.calls.append(("set_topology", topology))
        self.topology = topology

    def exclude_from_routing(self, engine_ids: Iterable[int]) -> None:
        self.calls.append(("exclude", tuple(engine_ids)))
        self.excluded |= set(engine_ids)

    def restore_routing(self, engine_ids: Iterable[int]) -> None:
        self.calls.append(("restore", tuple(engine_ids)))
        self.excluded -= set(engine_ids)

    async def send_scale(self, engine_ids: Iterable[int], message: ScaleMessage) -> list[int]:
        self.calls.append(("send", tuple(engine_ids), message))
        return []

    def migrate(self, engine_id: int, request_ids: Iterable[str] | None = None) -> int:
        ids = None if request_ids is None else tuple(request_ids)
        self.calls.append(("migrate", engine_id, ids))
        if not set(self.topology.engine_ids) - self.excluded - {engine_id}:
            # The real client fails each request: "every DP rank is draining".
            self.failed_moves.append(engine_id)
            return 0
        return len(ids) if ids is not None else self.migrate_counts.get(engine_id, 0)

    def sent(self, kind: type) -> list[tuple]:
        return [c for c in self.calls if c[0] == "send" and isinstance(c[2], kind)]


class FakeProcesses:
    """Joiners become ready when the test says so (``ready``) or fail (``fail``)."""

    def __init__(self) -> None:
        self.spawned: list[tuple[tuple[int, ...], Topology]] = []
        self.stopped: list[tuple[tuple[int, ...], bool]] = []
        self.release = threading.Event()
        self.failure: Exception | None = None

    def spawn(self, engine_ids: Iterable[int], topology: Topology) -> None:
        self.spawned.append((tuple(engine_ids), topology))

    def wait_for_joiners(self, engine_ids: Iterable[int], timeout_s: float) -> None:
        if not self.release.wait(timeout_s):
            raise EngineStartError(min(engine_ids), "not ready")
        if self.failure is not None:
            raise self.failure

    def stop(self, engine_ids: Iterable[int], *, force: bool = False, timeout_s: float = 10.0):
        self.stopped.append((tuple(engine_ids), force))
        return {}


class Stores:
    def __init__(self) -> None:
        self.made: list[str] = []

    def __call__(self) -> tuple[object, str]:
        addr = f"127.0.0.1:{5000 + len(self.made)}"
        self.made.append(addr)
        return object(), addr


def make(n: int = 2, timeouts: ScaleTimeouts = T):
    client = FakeClient(Topology.initial(n))
    procs = FakeProcesses()
    stores = Stores()
    ctl = ScaleController(client.topology, 8, bytes_per_expert=10, timeouts=timeouts)
    driver = ScaleDriver(ctl, client, procs, make_store=stores)
    records: list[dict] = []
    driver.add_listener(records.append)
    return driver, client, procs, stores, records


async def until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def report(driver: ScaleDriver, engine: int, event: ScaleEvent, **kw) -> None:
    rec = driver.controller.current
    assert rec is not None
    driver.on_report(ScaleReport(rec.operation_id, engine, rec.to_epoch, event, **kw))


# ----------------------------------------------------------------------------- tests


def test_scale_up_two_to_three():
    async def main() -> None:
        driver, client, procs, stores, records = make(2)
        call = asyncio.create_task(driver.scale(3, operation_id="up"))
        await until(lambda: procs.spawned)
        assert client.started == 1  # the driver started the reader its reports arrive on
        ((ids, topo),) = procs.spawned
        assert ids == (2,) and topo.engine_ids == [0, 1, 2] and topo.epoch == 1
        assert topo.store_address == stores.made[0]  # a fresh store for this operation
        assert driver.is_scaling and driver.owns_engine(2) and not driver.owns_engine(0)
        procs.release.set()  # the joiner's READY
        await until(lambda: client.sent(ScalePrepare))
        ((_, targets, prep),) = client.sent(ScalePrepare)
        assert targets == (0, 1, 2) and prep.joining == [2] and prep.operation_id == "up"
        for e in (0, 1, 2):
            report(driver, e, ScaleEvent.PREPARED)
        await until(lambda: client.sent(ScaleCommit))
        assert client.sent(ScaleCommit)[0][1] == (0, 1, 2)
        for e in (0, 1, 2):
            report(driver, e, ScaleEvent.COMMITTED, step=32)
        resp = await asyncio.wait_for(call, 5)
        assert resp.admission is Admission.STARTED and resp.status_code == 200
        assert resp.record.result == "succeeded"
        assert client.topology.engine_ids == [0, 1, 2] and client.topology.epoch == 1
        assert ("set_topology", topo) in client.calls
        assert not driver.is_scaling and procs.stopped == []
        assert driver._current_store is not None and driver._current_store[1] == stores.made[0]
        assert [r["operation_id"] for r in records] == ["up"]
        assert records[0]["result"] == "succeeded" and records[0]["to_size"] == 3
        assert driver.history()[-1]["operation_id"] == "up"
        # Same id again: the first record at once, nothing started.
        again = await driver.scale(3, operation_id="up")
        assert again.admission is Admission.DUPLICATE and again.record is resp.record
        assert len(procs.spawned) == 1
        driver.close()

    asyncio.run(main())


def test_joiner_exit_during_prepare_rolls_back():
    async def main() -> None:
        driver, client, procs, stores, records = make(2)
        call = asyncio.create_task(driver.scale(3, operation_id="up"))
        await until(lambda: procs.spawned)
        procs.release.set()
        await until(lambda: client.sent(ScalePrepare))
        report(driver, 0, ScaleEvent.PREPARED)
        assert driver.owns_engine(2)  # the client hands this exit to the driver
        driver.on_exit(2, -9)
        resp = await asyncio.wait_for(call, 5)
        rec = resp.record
        assert rec.result == "rolled_back" and "engine 2" in rec.cause
        ((_, targets, abort),) = client.sent(ScaleAbort)
        assert targets == (0, 1) and abort.operation_id == "up"
        await until(lambda: procs.stopped)
        assert procs.stopped == [((2,), True)]
        assert not client.sent(ScaleCommit) and client.topology.epoch == 0
        assert not any(c[0] == "set_topology" for c in client.calls)
        assert driver._stores == {} and driver._current_store is None  # destroyed at once
        assert records[-1]["result"] == "rolled_back"
        # The joiner's id is retired and the next operation works.
        procs.spawned.clear()
        client.calls.clear()
        call = asyncio.create_task(driver.scale(3, operation_id="again"))
        await until(lambda: client.sent(ScalePrepare))
        assert procs.spawned[0][0] == (3,)
        assert driver.owns_engine(2)  # a rolled-back joiner: never a serving member
        driver.close()
        with pytest.raises(Exception, match="shut down"):
            await call

    asyncio.run(main())


def test_joiner_that_fails_its_startup_rolls_back():
    async def main() -> None:
        driver, client, procs, _, records = make(2)
        procs.failure = EngineStartError(2, "engine 2 failed to start: boom")
        procs.release.set()
        resp = await asyncio.wait_for(driver.scale(3), 5)
        assert resp.record.result == "rolled_back" and "boom" in resp.record.cause
        assert client.sent(ScalePrepare) == []  # never prepared: nothing to abort
        await until(lambda: procs.stopped)
        assert procs.stopped == [((2,), True)]
        driver.close()

    asyncio.run(main())


def test_conflict_and_duplicate_are_answered_at_once():
    async def main() -> None:
        driver, client, procs, stores, _ = make(2)
        first = asyncio.create_task(driver.scale(3, operation_id="a"))
        await until(lambda: procs.spawned)
        other = await asyncio.wait_for(driver.scale(1, operation_id="b"), 1)
        assert other.admission is Admission.CONFLICT and other.status_code == 409
        assert other.record.operation_id == "a"
        dup = await asyncio.wait_for(driver.scale(3, operation_id="a"), 1)
        assert dup.admission is Admission.DUPLICATE and not dup.record.done
        assert len(stores.made) == 1  # no store for a request that could not start
        with pytest.raises(ValueError):
            await driver.scale(3, operation_id="")  # invalid id: 400, occupies nothing
        procs.release.set()
        await until(lambda: client.sent(ScalePrepare))
        report(driver, 1, ScaleEvent.FAILED, cause="rendezvous timed out")
        resp = await asyncio.wait_for(first, 5)
        assert resp.record.result == "rolled_back" and "rendezvous" in resp.record.cause
        driver.close()

    asyncio.run(main())


def test_invalid_size_is_a_value_error():
    async def main() -> None:
        driver, _, procs, stores, _ = make(2)
        with pytest.raises(ScalePlanError, match="maximum is 8"):
            await driver.scale(9)
        with pytest.raises(ValueError):
            await driver.scale(0)
        assert not driver.is_scaling and procs.spawned == []
        nothing = await driver.scale(2)
        assert nothing.record.result == "succeeded" and nothing.record.warnings
        driver.close()

    asyncio.run(main())


def test_scale_down_hands_back_migrates_and_stops_the_leaving_engine():
    async def main() -> None:
        driver, client, procs, _, records = make(3)
        call = asyncio.create_task(driver.scale(2, drain_timeout_s=1.0, operation_id="down"))
        await until(lambda: client.sent(ScalePrepare))
        kinds = [c[0] for c in client.calls]
        assert kinds[:2] == ["exclude", "send"] and client.calls[0][1] == (2,)
        assert driver.owns_engine(2)
        report(driver, 2, ScaleEvent.HANDED_BACK, request_ids=["x", "y"])
        for e in (0, 1, 2):
            report(driver, e, ScaleEvent.PREPARED)
        await until(lambda: client.sent(ScaleCommit))
        assert ("migrate", 2, ("x", "y")) in client.calls
        for e in (0, 1, 2):
            report(driver, e, ScaleEvent.COMMITTED, step=8)
        await until(lambda: procs.stopped)
        assert procs.stopped == [((2,), False)]  # SIGTERM: it drains and exits
        resp = await asyncio.wait_for(call, 5)
        rec = resp.record
        assert rec.result == "succeeded" and rec.requests_migrated == 2 and rec.leaving == [2]
        assert client.topology.engine_ids == [0, 1]
        assert driver.owns_engine(2)  # it left: an exit is no rank death
        assert records[-1]["requests_migrated"] == 2
        driver.close()

    asyncio.run(main())


def test_joiner_never_ready_hits_the_deadline():
    timeouts = ScaleTimeouts(
        start_engines_s=0.2,
        prepare_s=30,
        commit_s=10,
        finish_s=5,
        rendezvous_s=10,
        transfer_s=20,
        engine_commit_s=5,
    )

    async def main() -> None:
        driver, client, procs, _, _ = make(1, timeouts)
        resp = await asyncio.wait_for(driver.scale(2), 5)
        assert resp.record.result == "rolled_back" and "not ready" in resp.record.cause
        await until(lambda: procs.stopped)
        assert procs.stopped == [((1,), True)]
        procs.release.set()  # let the waiting thread end
        driver.close()

    asyncio.run(main())


def test_dead_member_found_while_serving_is_excluded_and_its_requests_migrate():
    async def main() -> None:
        driver, client, _, _, _ = make(3)
        client.migrate_counts[1] = 4
        # (The client calls on_exit only for engines the driver owns; a member's death
        # outside an operation fails the client today. Fed directly here.)
        driver.on_exit(1, -9)
        await until(lambda: ("exclude", (1,)) in client.calls)
        assert ("migrate", 1, None) in client.calls
        assert driver.controller.dead == {1}
        driver.close()

    asyncio.run(main())


@pytest.mark.parametrize("phase", ["prepare", "commit"])
def test_staying_engine_death_in_a_scale_down_moves_its_requests_after_the_rollback(phase):
    """2 -> 1, engine 1 draining, engine 0 (the one staying) killed: the rollback makes
    engine 1 routable again before engine 0's requests move, so none of them fails."""

    async def main() -> None:
        driver, client, procs, _, _ = make(2)
        client.migrate_counts[0] = 3
        call = asyncio.create_task(driver.scale(1, drain_timeout_s=5.0, operation_id="down"))
        await until(lambda: client.sent(ScalePrepare))
        assert client.excluded == {1}
        if phase == "commit":
            for e in (0, 1):
                report(driver, e, ScaleEvent.PREPARED)
            await until(lambda: client.sent(ScaleCommit))
        driver.on_exit(0, -9)
        if phase == "commit":
            await until(lambda: ("exclude", (0,)) in client.calls)
            report(driver, 1, ScaleEvent.ROLLED_BACK, cause="DP group failed")
        resp = await asyncio.wait_for(call, 5)
        assert resp.record.result == "rolled_back" and "engine" in resp.record.cause
        await until(lambda: ("migrate", 0, None) in client.calls)
        assert client.failed_moves == [] and client.excluded == {0}
        calls = client.calls
        assert calls.index(("restore", (1,))) < calls.index(("migrate", 0, None))
        driver.close()

    asyncio.run(main())
