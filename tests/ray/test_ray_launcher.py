"""The Ray launcher alone (``tidal/frontend/launchers/ray.py``) on a two-node cluster of one
CPU per node, with a stand-in engine (``idle_engine``): ranks numbered node by node, a
placement that cannot happen in time rolls back naming the missing CPU, a rank's exit and
its actor's death turn its sentinel readable, and closing frees every group and actor; a
rank started ahead (warm spare) that fails to start leaves nothing behind and is replaced;
a scale-up's start cancelled while it waits for placement gives up and leaves nothing."""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import wait as wait_sentinels

import psutil
import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

ENTRY = "tests.ray.idle_engine"


@pytest.fixture(scope="module")
def config(qwen3_ckpt):
    from tidal.launch.engine_args import EngineArgs

    return EngineArgs(
        model=qwen3_ckpt,
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_elastic_ep=True,
        data_parallel_backend="ray",
        ray_placement_timeout_s=120.0,  # placements that can happen (a loaded host)
        device="cpu",
    ).create_engine_config()


@pytest.fixture(scope="module")
def spare_config(config):
    """``config`` keeping one rank started ahead."""
    return config.with_parallel(ray_warm_ranks=1)


def _free_cpus() -> float:
    import ray

    return ray.available_resources().get("CPU", 0.0)


def _live_actors() -> list:
    """Actors not dead, from the GCS (the state API needs the dashboard, not run here)."""
    import ray

    return [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]


def test_launcher_places_numbers_and_frees(ray_cluster, config):
    from tidal.frontend.launchers.base import PlacementError
    from tidal.frontend.launchers.ray import RayLauncher

    launcher = RayLauncher(config, entry_module=ENTRY)
    ranks = {}
    try:
        ranks = launcher.start([0, 1], "tcp://127.0.0.1:1", warm=False)
        nodes = {e: launcher.node_of(e) for e in ranks}
        assert len(set(nodes.values())) == 2  # one CPU per node: a node per rank
        # Node by node: rank order follows (node IP, node id); same IP here, so node id.
        assert nodes[0] < nodes[1]
        for h in ranks.values():  # the engine process, named once it has started
            assert wait_until(lambda h=h: psutil.Process(h.pid).name().startswith("EngineCore"))
        assert wait_until(lambda: _free_cpus() == 0.0, 30)

        # No free node: the third rank cannot be placed in its launcher's 3 s; nothing
        # of the attempt remains.
        short = RayLauncher(config.with_parallel(ray_placement_timeout_s=3.0), ENTRY)
        try:
            with pytest.raises(PlacementError, match=r"not placed within 3s.*CPU 1 \(free 0 of 2"):
                short.start([2], "tcp://127.0.0.1:1", warm=True)
        finally:
            short.close()
        assert len(_live_actors()) == 2

        # A rank's engine ends (SIGTERM through its actor): its sentinel turns readable.
        ranks[1].terminate()
        assert wait_sentinels([ranks[1].sentinel], 60)
        assert ranks[1].exitcode == 0
        # The other's actor dies (Ray kills it): its engine leaves, the sentinel says so.
        pid0 = ranks[0].pid
        import ray

        ray.kill(ranks[0]._slot.actor, no_restart=True)
        assert wait_sentinels([ranks[0].sentinel], 60)
        assert ranks[0].exitcode == -9
        assert wait_until(lambda: not psutil.pid_exists(pid0), 30)
    finally:
        _close(launcher, ranks)
    assert wait_until(lambda: _free_cpus() == 2.0, 30)
    assert wait_until(lambda: not _live_actors(), 30)


def _close(launcher, ranks: dict) -> None:
    """Stop every rank this test started, then the launcher."""
    for h in ranks.values():
        h.kill()
        h.join(10)
        h.close()
    launcher.close()


def _assert_nothing_left(launcher) -> None:
    """No placement group, actor or CPU of this launcher's is held any more."""
    assert wait_until(lambda: not _live_groups(launcher), 30)
    assert wait_until(lambda: not _live_actors(), 30)
    assert wait_until(lambda: _free_cpus() == 2.0, 30)


def _live_groups(launcher) -> list:
    """The launcher's placement groups not removed, from the GCS."""
    from ray.util.placement_group import placement_group_table

    prefix = f"tidal-{launcher._tag}-"
    return [
        g
        for g in placement_group_table().values()
        if g["name"].startswith(prefix) and g["state"] != "REMOVED"
    ]


def test_a_spare_that_fails_to_start_is_removed_and_replaced(
    ray_cluster, spare_config, monkeypatch, caplog
):
    from ray.exceptions import GetTimeoutError

    from tidal.frontend.launchers import ray as ray_launcher

    monkeypatch.setattr(ray_launcher, "SPARE_RETRY_S", 0.1, raising=False)
    launcher = ray_launcher.RayLauncher(spare_config, entry_module=ENTRY)
    # The first two spares fail once their actors are up: one as Ray reports a lost
    # actor, one with an error Ray does not raise (the keeper must outlive both).
    failures = [GetTimeoutError("the warm launcher answered nothing"), RuntimeError("a bug")]
    locate = launcher._locate

    def failing_locate(slots):
        locate(slots)
        if threading.current_thread().name == "ray-spares" and failures:
            raise failures.pop(0)

    launcher._locate = failing_locate
    ranks = {}
    try:
        with caplog.at_level(logging.ERROR, logger=ray_launcher.__name__):
            ranks = launcher.start([0], "tcp://127.0.0.1:1", warm=False)
            # The spare can only go to the other node: a failed one that kept its group
            # would hold that node's CPU, and no replacement could be placed.
            assert wait_until(lambda: not failures and len(launcher._spares) == 1, 120)
        failed = [r for r in caplog.records if "failed to start" in r.getMessage()]
        assert len(failed) == 2
        assert "the warm launcher answered nothing" in failed[0].getMessage()
        assert "a bug" in failed[1].getMessage()
        # The rank's group and actor, and the spare's: nothing of the failed ones.
        assert len(_live_groups(launcher)) == 2
        assert wait_until(lambda: len(_live_actors()) == 2, 30)
    finally:
        _close(launcher, ranks)
    _assert_nothing_left(launcher)


def test_a_start_cancelled_while_waiting_for_placement_leaves_nothing(ray_cluster, config):
    from tidal.frontend.launchers.base import LaunchError, PlacementError
    from tidal.frontend.launchers.ray import RayLauncher

    # Placement waits long: only the cancel can end the scale-up's start in this test.
    launcher = RayLauncher(config.with_parallel(ray_placement_timeout_s=600.0), ENTRY)
    ranks = {}
    outcome: dict[str, object] = {}

    def scale_up() -> None:
        try:
            outcome["started"] = launcher.start([2], "tcp://127.0.0.1:1", warm=True)
        except LaunchError as e:
            outcome["error"] = e

    starter = threading.Thread(target=scale_up)
    try:
        ranks = launcher.start([0, 1], "tcp://127.0.0.1:1", warm=False)  # every node taken
        starter.start()
        assert wait_until(lambda: len(_live_groups(launcher)) == 3, 60)  # 2's group waits
        launcher.cancel([2])  # its scale-up rolled back
        starter.join(120)
        assert not starter.is_alive()
        err = outcome.get("error")
        assert isinstance(err, LaunchError) and not isinstance(err, PlacementError), outcome
        assert err.engine_id == 2 and "cancelled" in str(err)
        assert wait_until(lambda: len(_live_groups(launcher)) == 2, 30)  # its group removed
        assert len(_live_actors()) == 2
    finally:
        launcher.cancel([2])
        if starter.ident is not None:
            starter.join(120)
        _close(launcher, ranks)
    _assert_nothing_left(launcher)
