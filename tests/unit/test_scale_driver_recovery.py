"""ScaleDriver, rank death (docs/architecture.md#faults): which exits it claims, how it admits the
controller's own recovery (``AdmitScale``) and fails the deployment (``FailDeployment``).
The fake client and process manager of test_scale_driver; the test plays the engines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.unit.test_scale_driver import FakeClient, FakeProcesses, Stores, T, until
from tidal.frontend.scaling.scale_controller import ScaleController
from tidal.frontend.scaling.scale_driver import ScaleDriver
from tidal.frontend.scaling.scale_events import EngineExited
from tidal.protocol.elastic import ScaleCommit, ScaleEvent, ScalePrepare, ScaleReport
from tidal.protocol.topology import Topology

pytestmark = pytest.mark.timeout(60)


class RecoveryClient(FakeClient):
    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self.failed: list[str] = []

    def fail_deployment(self, reason: str) -> None:
        self.calls.append(("fail_deployment", reason))
        self.failed.append(reason)
        if self.dead_reason is None:
            self.dead_reason = reason


class FailingStores(Stores):
    """The first ``fail`` stores cannot be made."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__()
        self.fail = fail

    def __call__(self) -> tuple[object, str]:
        if self.fail:
            self.fail -= 1
            raise OSError("no free port")
        return super().__call__()


def make(
    n: int = 3,
    *,
    recover: bool = True,
    num_redundant: int = 0,
    stores: Callable[[], tuple[object, str]] | None = None,
    **kw,
):
    client = RecoveryClient(Topology.initial(n))
    procs = FakeProcesses()
    stores = stores or Stores()
    ctl = ScaleController(
        client.topology,
        8,
        num_redundant,
        bytes_per_expert=10,
        timeouts=T,
        recover=recover,
        **kw,
    )
    driver = ScaleDriver(ctl, client, procs, make_store=stores)
    records: list[dict] = []
    driver.add_listener(records.append)
    return driver, client, procs, stores, records


def report(driver: ScaleDriver, engine: int, event: ScaleEvent, **kw) -> None:
    rec = driver.controller.current
    assert rec is not None
    driver.on_report(ScaleReport(rec.operation_id, engine, rec.to_epoch, event, **kw))


def recoveries(driver: ScaleDriver) -> list[dict]:
    return [r for r in driver.history() if r["trigger"] == "recovery"]


# ----------------------------------------------------------------------------- tests


def test_owns_engine_claims_a_member_while_another_is_live():
    async def main() -> None:
        driver, _, _, _, _ = make(2)
        assert driver.owns_engine(0) and driver.owns_engine(1)
        assert driver.owns_engine(7)  # no member at all: never a rank death
        driver.on_exit(0, -9)
        # The last live member: its exit fails the client.
        assert not driver.owns_engine(1)
        await until(lambda: driver.controller.dead == {0})
        assert not driver.owns_engine(1)
        driver.close()

    asyncio.run(main())


def test_owns_engine_not_for_the_only_member_or_without_recover():
    single, _, _, _, _ = make(1)
    assert not single.owns_engine(0)
    off, _, _, _, _ = make(3, recover=False)
    assert not off.owns_engine(0) and not off.owns_engine(2)
    assert off.owns_engine(5)


def test_a_member_death_is_admitted_as_a_recovery():
    async def main() -> None:
        driver, client, procs, stores, records = make(3)
        client.migrate_counts[1] = 3
        assert driver.owns_engine(1)
        driver.on_exit(1, -9)
        await until(lambda: client.sent(ScalePrepare))
        assert ("exclude", (1,)) in client.calls and ("migrate", 1, None) in client.calls
        ((_, targets, prep),) = client.sent(ScalePrepare)
        assert targets == (0, 2) and prep.dead == [1] and prep.leaving == [1]
        assert prep.operation_id.startswith("recover-")
        assert prep.topology.store_address == stores.made[0]  # its own store
        (rec,) = recoveries(driver)
        assert rec["operation_id"] == prep.operation_id and rec["dead"] == [1]
        assert rec["result"] is None and driver.is_scaling
        assert procs.spawned == []  # nobody joins a recovery to the live size
        assert driver.controller.degraded is not None
        for e in (0, 2):
            report(driver, e, ScaleEvent.PREPARED)
        await until(lambda: client.sent(ScaleCommit))
        assert client.sent(ScaleCommit)[0][1] == (0, 2)
        for e in (0, 2):
            report(driver, e, ScaleEvent.COMMITTED, step=8)
        await until(lambda: records)
        assert records[-1]["trigger"] == "recovery" and records[-1]["result"] == "succeeded"
        assert client.topology.engine_ids == [0, 2] and client.topology.epoch == 1
        assert recoveries(driver)[0]["result"] == "succeeded"
        assert driver._current_store is not None and driver._current_store[1] == stores.made[0]
        faults = driver.controller.faults()
        assert faults["rank_deaths"] == 1 and faults["recovered"] == 1
        assert faults["deaths"][0]["requests_migrated"] == 3
        assert faults["degraded"] is None and client.failed == []
        assert (1,) in [ids for ids, _ in procs.stopped]  # reaped
        driver.close()

    asyncio.run(main())


def test_a_recovery_that_could_not_be_admitted_is_asked_again():
    async def main() -> None:
        stores = FailingStores(fail=1)
        driver, client, _, _, _ = make(3, stores=stores, recovery_retry_s=0.05)
        driver.on_exit(2, -9)
        await until(lambda: client.sent(ScalePrepare))
        assert stores.fail == 0 and len(stores.made) == 1  # the second try got its store
        ((_, targets, prep),) = client.sent(ScalePrepare)
        assert targets == (0, 1) and prep.dead == [2]
        (rec,) = recoveries(driver)
        assert rec["operation_id"] == prep.operation_id
        driver.close()

    asyncio.run(main())


def test_fail_deployment_reaches_the_client():
    async def main() -> None:
        # Both members die before the recovery asked for the first death is admitted:
        # both exits reach the controller back to back, as ``on_exit`` posts them once
        # each process is reaped.
        driver, client, procs, _, _ = make(2)
        assert driver.owns_engine(0)
        driver._post(EngineExited(0, "exited with code -9"))
        driver._post(EngineExited(1, "exited with code -9"))
        await until(lambda: client.failed)
        (reason,) = client.failed
        assert "every engine" in reason and ("fail_deployment", reason) in client.calls
        assert client.sent(ScalePrepare) == [] and recoveries(driver) == []
        assert procs.spawned == []
        driver.close()

    asyncio.run(main())


def test_on_exit_cause_names_the_death():
    async def main() -> None:
        driver, client, _, _, _ = make(3)
        driver.on_exit(2, -9, "no heartbeat for 3.1s")
        await until(lambda: driver.controller.policy.deaths)
        (death,) = driver.controller.policy.deaths
        assert death.engine_id == 2 and death.cause == "no heartbeat for 3.1s"
        assert driver.controller.faults()["deaths"][0]["cause"] == "no heartbeat for 3.1s"
        driver.close()

        other, _, _, _, _ = make(3)
        other.on_exit(1, -9)
        await until(lambda: other.controller.policy.deaths)
        assert other.controller.policy.deaths[0].cause == "exited with code -9"
        other.close()

    asyncio.run(main())


def test_the_driver_is_quiet_after_a_recovery():
    async def main() -> None:
        driver, client, _, _, records = make(2)
        ticks = 0
        tick = driver.controller.tick

        def counting(now: float) -> list:
            nonlocal ticks
            ticks += 1
            return tick(now)

        driver.controller.tick = counting  # type: ignore[method-assign]
        driver.on_exit(1, -9)
        await until(lambda: client.sent(ScalePrepare))
        report(driver, 0, ScaleEvent.PREPARED)
        await until(lambda: client.sent(ScaleCommit))
        report(driver, 0, ScaleEvent.COMMITTED, step=8)
        await until(lambda: records)
        assert records[-1]["result"] == "succeeded"
        ticks = 0
        for _ in range(200):  # event-loop turns, no time passes
            await asyncio.sleep(0)
        driver.close()
        assert ticks <= 1, f"{ticks} ticks with nothing to do"

    asyncio.run(main())
