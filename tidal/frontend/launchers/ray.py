"""``--data-parallel-backend ray``: engine ranks as Ray actors in placement groups
(docs/architecture.md#launchers). The only module of Tidal, with ``ray_actor``, that imports Ray.

Per rank: one placement group of its own, one ``EngineActor`` in it, and the engine
process the actor starts beside itself on that node. The group is one bundle:
``ray_cpus_per_rank`` CPUs for the engine core, plus on CUDA one GPU per TP worker. One
bundle, not a GPU bundle per worker: an actor takes its resources from one bundle, and Ray
gives GPU ids (``CUDA_VISIBLE_DEVICES``) only to the actor that holds them; the TP workers
are the engine's own processes, which inherit them and take one each (``device_ids``
index them). Ray places, starts, watches and stops; the engine speaks Tidal's protocols
to the frontend over TCP with CURVE, as a ``--headless`` rank does.

- Launch: every group is created, then waited for together until
  ``ray_placement_timeout_s``; ranks are numbered node by node (the frontend's node
  first, then by node IP and id), so a node's ranks are neighbours in the DP/EP order.
- Scale-up (``start(..., warm=True)``): ranks kept started ahead (``ray_warm_ranks``:
  group placed, actor up, its warm engine launcher imported) are taken first (waiting
  for those still starting), spare groups still waiting for resources are adopted, and
  fresh groups are created for the rest, with the same deadline. A group not placed in time
  fails the operation with ``PlacementError`` naming what the cluster lacks, and every
  group and actor this call made is removed (the scale controller then rolls back). A
  scale-up rolled back meanwhile (``cancel``) stops waiting and removes them the same way.
- Scale-down and stop: the engine drains on SIGTERM (sent through its actor) and exits;
  ``close`` then kills the actor and removes its group, in that order.
- Threads: ``start`` on the caller's (one at a time); ``_watch`` (rank exits);
  ``_keep_spares`` (ranks started ahead), which shares ``_spares``, ``_pending_spares``
  and ``_promoting`` with ``start`` under ``_lock``: a group is either pending (a
  scale-up may adopt it), promoting (its actor starting: a scale-up waits for it) or a
  spare (taken whole), never two of these.
- Deaths: each rank's ``wait_exit`` call is watched by one thread (``ray.wait``); when it
  returns (the engine exited) or fails (Ray reports the actor or its node dead) the
  handle's sentinel turns readable and the process manager sees a rank death like a local
  one (docs/architecture.md#faults). Tidal's own heartbeats usually see a frozen or lost rank first.
  Nothing is restarted by Ray (``max_restarts=0``): Tidal never gang-restarts, its
  recovery removes the dead rank.
- The cluster: ``ray_address`` or ``$RAY_ADDRESS``, else a local one started here and
  stopped at ``close``. Unreachable: ``LauncherError`` at start, naming the address.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tidal.config import EngineConfig
from tidal.engine_core.entry import (
    ENGINE_ENTRY_MODULE,
    ENGINE_ZYGOTE_MODULE,
    encode_engine_launch,
    engine_process_name,
)
from tidal.frontend.launchers.base import (
    EngineHandle,
    Launcher,
    LaunchError,
    LauncherUnavailable,
    PlacementError,
)
from tidal.frontend.launchers.ray_actor import EngineActor
from tidal.frontend.launchers.registry import KINDS

logger = logging.getLogger(__name__)

# An actor answers a call on a live node in milliseconds; its creation takes a worker
# process (seconds on a loaded node).
ACTOR_START_TIMEOUT_S = 120.0
# Actor threads: wait_exit blocks one; info, start and signal need the others.
ACTOR_THREADS = 4
REACH_TIMEOUT_S = 5.0  # a TCP connect to the cluster's address
# A live actor answers a kill in milliseconds; past this it is killed itself.
KILL_ANSWER_TIMEOUT_S = 2.0
# After a rank started ahead failed to start, the next one is tried this much later (a
# cause that persists would otherwise make and remove an actor five times a second).
SPARE_RETRY_S = 2.0


class LauncherError(LauncherUnavailable):
    """The Ray cluster cannot be used (unreachable, not a cluster)."""


@dataclass
class _Slot:
    """A rank's home on the cluster: its placement group and the actor in it."""

    pg: PlacementGroup
    actor: Any  # the EngineActor's handle (Ray types each actor's proxy by its class)
    node_id: str = ""
    node_ip: str = ""
    actor_pid: int = 0
    local_ranks: int = 1  # the engine's data_parallel_size_local (its thread share)


class RayEngine:
    """A rank started by ``RayLauncher``: its actor, group and engine process, behind the
    interface process managers use (``EngineHandle``). ``pid`` is the engine process's;
    ``node`` the Ray node id it runs on."""

    def __init__(self, name: str, slot: _Slot, pid: int) -> None:
        self.name = name
        self.pid = pid
        self.node = slot.node_id
        self._slot = slot
        self._exit_ref = slot.actor.wait_exit.remote()
        self._exitcode: int | None = None
        self._done = threading.Event()
        self._r, self._w = os.pipe()  # the write end closes when the rank has exited
        self._closed = False

    @property
    def sentinel(self) -> int:
        return self._r

    def _exited(self, code: int | None) -> None:
        if self._done.is_set():
            return
        # A rank whose actor or node died has no exit code; -9 says it was killed.
        self._exitcode = -9 if code is None else code
        self._done.set()
        os.close(self._w)

    @property
    def exitcode(self) -> int | None:
        return self._exitcode if self._done.is_set() else None

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def terminate(self) -> None:
        """SIGTERM to the engine (it drains, then exits), through its actor."""
        if not self._done.is_set():
            self._slot.actor.signal.remote(False)

    def kill(self) -> None:
        """SIGKILL to the engine through its actor (works on a frozen engine: the actor
        is another process); when the actor cannot be reached, the actor is killed, and
        its engine, which watches it, leaves. Returns at once: the actor's answer is
        waited for on a thread of its own, since callers (the liveness check on the event
        loop, a stop of several ranks) must not wait seconds per rank of a lost node."""
        if self._done.is_set():
            return
        ref = self._slot.actor.signal.remote(True)
        threading.Thread(
            target=self._confirm_kill, args=(ref,), name=f"ray-kill-{self.name}", daemon=True
        ).start()

    def _confirm_kill(self, ref: ray.ObjectRef) -> None:
        try:
            ray.get(ref, timeout=KILL_ANSWER_TIMEOUT_S)
        except (GetTimeoutError, RayError):
            try:
                ray.kill(self._slot.actor, no_restart=True)
            except (RayError, ValueError):
                pass  # gone already (closed meanwhile)
        except Exception:  # noqa: BLE001 - Ray shut down under us: nothing is left to kill
            logger.debug("%s: kill not confirmed", self.name, exc_info=True)

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def close(self) -> None:
        """Kill the actor, then remove its placement group (the rank is stopped)."""
        if self._closed:
            return
        self._closed = True
        _free_slot(self._slot)
        if not self._done.is_set():
            self._exited(None)
        os.close(self._r)


def _free_slot(slot: _Slot) -> None:
    try:
        ray.kill(slot.actor, no_restart=True)
    except (RayError, ValueError):
        pass  # already gone
    _remove_group(slot.pg)


def _remove_group(pg: PlacementGroup) -> None:
    try:
        remove_placement_group(pg)
    except (RayError, ValueError):
        pass  # already removed


class RayLauncher(Launcher):
    kind = KINDS["ray"]

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        self.config = config
        par = config.parallel
        self._entry_module = entry_module or ENGINE_ENTRY_MODULE
        self._timeout_s = par.ray_placement_timeout_s
        self._bundles = _bundles(config)
        self._owns_ray = False
        self._connect(par.ray_address)
        self._tag = uuid.uuid4().hex[:8]  # names this deployment's groups
        self._driver_node = ray.get_runtime_context().get_node_id()
        self._lock = threading.Lock()  # guards _ranks, the spares, _closed
        self._ranks: dict[int, RayEngine] = {}
        self._closed = False
        # Ranks started ahead (elastic EP): placed, actor up, warm launcher importing.
        self._want_spares = par.ray_warm_ranks if par.enable_elastic_ep else 0
        self._spares: list[_Slot] = []
        self._pending_spares: list[PlacementGroup] = []  # waiting for resources
        self._promoting = 0  # spares placed, their actors starting
        self._spare_ready = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._keeper_stop = threading.Event()  # set at close
        self._cancelled: set[int] = set()  # ids whose start a rolled-back scale-up cancelled
        self._watcher = threading.Thread(target=self._watch, name="ray-rank-watch", daemon=True)
        self._watcher.start()
        self._keeper: threading.Thread | None = None  # started after the launch ranks

    # ---- the cluster ------------------------------------------------------------------

    def _connect(self, address: str | None) -> None:
        if ray.is_initialized():
            return  # the embedding program joined a cluster already (a Ray job)
        address = address or os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = {} if address else {"include_dashboard": False}
        # ray.init makes SIGTERM exit the process at once (``sys.exit``): the server's
        # own handler (drain, stop the ranks) is put back.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            _check_reachable(address)
            ray.init(address=address, namespace="tidal", **kwargs)
        except Exception as e:  # noqa: BLE001 - Ray raises several kinds; all mean the same
            where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
            raise LauncherError(
                f"data_parallel_backend ray: cannot use {where} ({type(e).__name__}: {e}); "
                "check --ray-address / RAY_ADDRESS, or `ray status` on the head node"
            ) from e
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_sigterm)
        self._owns_ray = True

    def node_ip(self) -> str:
        """This (the frontend's) node's IP as the cluster sees it: where ranks find it."""
        return ray.util.get_node_ip_address()

    # ---- starting ranks ---------------------------------------------------------------

    def start(
        self, engine_ids: Sequence[int], handshake_address: str, *, warm: bool
    ) -> dict[int, EngineHandle]:
        ids = sorted(engine_ids)
        slots, adopted = self._take_spares(ids) if warm else ([], [])
        fresh: list[_Slot] = []
        try:
            fresh = self._place(ids, len(ids) - len(slots), adopted)
            slots = _node_order(slots + fresh, self._driver_node)
            self._check_cancelled(ids)
            started = self._start_engines(ids, slots, handshake_address)
        except BaseException as err:
            for slot in slots + [s for s in fresh if s not in slots]:
                _free_slot(slot)
            with self._lock:
                self._cancelled.difference_update(ids)  # ids are never started again
            if isinstance(err, (LaunchError, KeyboardInterrupt)):
                raise
            raise LaunchError(ids[0], f"Ray could not start engines {ids}: {err}") from err
        if self._want_spares and self._keeper is None:
            # After the launch ranks, which come first; the spares take what is left.
            self._keeper = threading.Thread(
                target=self._keep_spares, name="ray-spares", daemon=True
            )
            self._keeper.start()
        return started

    def cancel(self, engine_ids: Sequence[int]) -> None:
        """A scale-up rolled back: its ``start`` stops waiting for placement or for
        spares, removes what it made and raises ``LaunchError``."""
        with self._spare_ready:
            self._cancelled.update(engine_ids)
            self._spare_ready.notify_all()  # a start waiting for spares

    def _is_cancelled(self, ids: Sequence[int]) -> bool:
        with self._lock:
            return not self._cancelled.isdisjoint(ids)

    def _check_cancelled(self, ids: list[int]) -> None:
        if self._is_cancelled(ids):
            raise LaunchError(ids[0], f"the start of engines {ids} was cancelled")

    def _place(
        self, ids: list[int], count: int, adopted: list[PlacementGroup] | None = None
    ) -> list[_Slot]:
        """``count`` groups (``adopted`` ones, already asked of Ray, then new ones), each
        with an actor, all placed within the deadline, or none (``PlacementError`` naming
        the missing resources; ``LaunchError`` when cancelled meanwhile)."""
        if count == 0:
            return []
        pgs = list(adopted or []) + [self._new_group() for _ in range(count - len(adopted or []))]
        pending = _wait_placed(pgs, self._timeout_s, lambda: self._is_cancelled(ids))
        if pending or self._is_cancelled(ids):
            for pg in pgs:
                remove_placement_group(pg)
            self._check_cancelled(ids)
            raise PlacementError(ids[0], self._missing(count, pending, f"engine(s) {ids}"))
        slots = [self._new_slot(pg) for pg in pgs]
        try:
            self._locate(slots)
        except BaseException:
            for slot in slots:
                _free_slot(slot)
            raise
        return slots

    def _new_group(self) -> PlacementGroup:
        return placement_group(
            self._bundles, strategy="STRICT_PACK", name=f"tidal-{self._tag}-{uuid.uuid4().hex[:8]}"
        )

    def _new_slot(self, pg: PlacementGroup, *, warm: bool = False) -> _Slot:
        actor = (
            ray.remote(EngineActor)
            .options(
                num_cpus=self._bundles[0]["CPU"],
                num_gpus=self._bundles[0].get("GPU", 0),
                max_concurrency=ACTOR_THREADS,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0
                ),
            )
            .remote(ENGINE_ZYGOTE_MODULE if warm else None, self.config.parallel.ray_cpus_per_rank)
        )
        return _Slot(pg, actor)

    def _locate(self, slots: list[_Slot]) -> None:
        """Wait for the actors to come up; note where each runs."""
        infos = ray.get([s.actor.info.remote() for s in slots], timeout=ACTOR_START_TIMEOUT_S)
        for slot, info in zip(slots, infos):
            slot.node_id, slot.node_ip, slot.actor_pid = info["node_id"], info["ip"], info["pid"]
            slot.local_ranks = info["local_ranks"]

    def _missing(self, wanted: int, pending: int, what: str) -> str:
        """Why ``pending`` of ``wanted`` groups were not placed: what a rank needs on one
        node beside what the cluster has free."""
        free, total = ray.available_resources(), ray.cluster_resources()
        need = ", ".join(
            f"{k} {v:g} (free {free.get(k, 0.0):g} of {total.get(k, 0.0):g} in the cluster)"
            for k, v in _sum_bundles(self._bundles).items()
        )
        return (
            f"cannot place {what} on the Ray cluster: {pending} of {wanted} placement group(s) "
            f"not placed within {self._timeout_s:g}s; each rank needs on one node: {need}. "
            "Add a node (`ray start --address ...`) or free those resources"
        )

    def _start_engines(
        self, ids: list[int], slots: list[_Slot], handshake_address: str
    ) -> dict[int, EngineHandle]:
        pids = []
        for e, slot in zip(ids, slots):
            cfg = self.config.with_parallel(
                data_parallel_rank=e, data_parallel_size_local=slot.local_ranks
            )
            # The actor is the engine's launcher: the engine leaves when it is gone.
            payload = encode_engine_launch(cfg, e, handshake_address, slot.actor_pid)
            pids.append(
                slot.actor.start.remote(engine_process_name(e), payload, self._entry_module)
            )
        started = ray.get(pids, timeout=ACTOR_START_TIMEOUT_S)
        handles = {
            e: RayEngine(engine_process_name(e), s, pid)
            for e, s, (pid, _) in zip(ids, slots, started)
        }
        for e, (pid, warm) in zip(ids, started):
            logger.info("engine %d: pid %d, %s", e, pid, "warm (forked)" if warm else "cold")
        with self._lock:
            self._ranks.update(handles)
        self._wake.set()
        for e, h in handles.items():
            logger.info("engine %d: Ray node %s, pid %d", e, h.node, h.pid)
        return dict(handles)

    def node_of(self, engine_id: int) -> str | None:
        with self._lock:
            r = self._ranks.get(engine_id)
        return None if r is None else r.node

    def release(self, engine_id: int) -> None:
        """Its actor and group go with the handle's ``close``; here it is only forgotten."""
        with self._lock:
            self._ranks.pop(engine_id, None)
            self._cancelled.discard(engine_id)

    def frontend_host(self, configured: str) -> str:
        """The frontend's node IP as Ray knows it, unless ``--data-parallel-address`` names
        an address that is not loopback (ranks on other nodes could not reach loopback)."""
        return self.node_ip() if _is_loopback(configured) else configured

    # ---- watching ranks ---------------------------------------------------------------

    def _watch(self) -> None:
        """Turn each rank's ``wait_exit`` result (or failure: actor or node dead) into
        its sentinel."""
        while True:
            with self._lock:
                if self._closed:
                    return
                refs = {r._exit_ref: r for r in self._ranks.values() if r.is_alive()}
            if not refs:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            for ref in done:
                try:
                    code = ray.get(ref)
                except RayError as e:
                    logger.error("engine %s: Ray reports its actor dead (%s)", refs[ref].name, e)
                    code = None
                refs[ref]._exited(code)

    # ---- ranks started ahead ----------------------------------------------------------

    def _keep_spares(self) -> None:
        """Keep ``ray_warm_ranks`` ranks started ahead: a group (waits for resources as
        long as it takes), an actor, a warm engine launcher. A failed turn is logged and
        retried after ``SPARE_RETRY_S``: this thread is the only one that keeps spares."""
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                ok = self._keep_spares_once()
            except Exception:  # noqa: BLE001 - Ray raises several kinds; the keeper goes on
                logger.exception("keeping ranks started ahead failed: retried")
                ok = False
            # Its own event: ``_wake`` stays set while ranks run, so it would not wait.
            self._keeper_stop.wait(0.2 if ok else SPARE_RETRY_S)

    def _keep_spares_once(self) -> bool:
        """One turn: ask for the missing groups, promote the placed ones. False when a
        spare failed to start (the next is asked for after a pause, not at once)."""
        with self._lock:
            have = len(self._spares) + len(self._pending_spares) + self._promoting
            short = self._want_spares - have
        for _ in range(short):
            pg = self._new_group()
            with self._lock:
                keep = not self._closed
                if keep:
                    self._pending_spares.append(pg)
            if not keep:  # close took its list already
                _remove_group(pg)
                return True
        with self._lock:
            pending = list(self._pending_spares)
        ok = True
        for pg in pending:
            if _is_placed(pg):
                ok = self._promote(pg) and ok
        return ok

    def _promote(self, pg: PlacementGroup) -> bool:
        """A spare's group is placed: start its actor (with a warm launcher). False when
        it failed to start: its actor and group are removed (a scale-up would otherwise
        find the node's resources held by nothing)."""
        with self._lock:
            if self._closed or pg not in self._pending_spares:
                return True  # taken by a scale-up meanwhile
            self._pending_spares.remove(pg)
            self._promoting += 1
        slot: _Slot | None = None
        started = False
        try:
            slot = self._new_slot(pg, warm=True)
            self._locate([slot])
            # Ready once its warm launcher has done the imports a scale-up would wait for.
            if not ray.get(slot.actor.warm_up.remote(ACTOR_START_TIMEOUT_S)):
                logger.warning("a rank started ahead has no warm launcher: starts cold")
            logger.info("a rank started ahead is ready on Ray node %s", slot.node_id)
            started = True
        except Exception as e:  # noqa: BLE001 - whatever failed, nothing of it may stay
            logger.error("a rank started ahead failed to start (%r): removed, replaced", e)
        finally:
            with self._spare_ready:
                self._promoting -= 1
                keep = started and not self._closed
                if keep and slot is not None:
                    self._spares.append(slot)
                self._spare_ready.notify_all()
            if not keep:
                if slot is not None:
                    _free_slot(slot)
                else:
                    _remove_group(pg)
        return started

    def _take_spares(self, ids: list[int]) -> tuple[list[_Slot], list[PlacementGroup]]:
        """Up to ``len(ids)`` ranks started ahead, waiting for those whose actors and warm
        launchers are starting (already placed: waiting for them beats a fresh group that
        would find their node taken; not once ``ids`` are cancelled); for the rest, the
        spare groups still waiting for resources (the scale-up adopts them: they are first
        in Ray's queue)."""
        count = len(ids)
        deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
        with self._spare_ready:
            if not self._want_spares:
                return [], []
            taken: list[_Slot] = []
            while True:
                n = count - len(taken)
                taken += self._spares[:n]
                self._spares = self._spares[n:]
                left = deadline - time.monotonic()
                if len(taken) == count or not self._promoting or left <= 0:
                    break
                if not self._cancelled.isdisjoint(ids):
                    break
                self._spare_ready.wait(left)
            n = count - len(taken)
            adopted, self._pending_spares = self._pending_spares[:n], self._pending_spares[n:]
        logger.info(
            "scale-up: %d rank(s) started ahead, %d group(s) adopted", len(taken), len(adopted)
        )
        return taken, adopted

    # ---- the end ----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            spares, pending = self._spares, self._pending_spares
            self._spares, self._pending_spares = [], []
            ranks = list(self._ranks.values())
        self._wake.set()
        self._keeper_stop.set()
        for slot in spares:
            _free_slot(slot)
        for pg in pending:
            remove_placement_group(pg)
        for r in ranks:  # normally closed by the process manager already
            r.close()
        self._watcher.join(5)
        if self._keeper is not None:
            self._keeper.join(5)
        if self._owns_ray:
            ray.shutdown()


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_reachable(address: str | None) -> None:
    """Fail in seconds when a ``host:port`` cluster address answers nothing: ``ray.init``
    would retry for minutes. ``auto`` and ``ray://`` addresses are left to Ray."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S):
        pass


def _bundles(config: EngineConfig) -> list[dict[str, float]]:
    """A rank's placement group (module docstring): one bundle, the engine core's CPU plus
    one GPU per TP worker on CUDA (on CPU the TP workers share the rank's node)."""
    bundle = {"CPU": float(config.parallel.ray_cpus_per_rank)}
    if config.device == "cuda":
        bundle["GPU"] = float(config.parallel.tensor_parallel_size)
    return [bundle]


def _sum_bundles(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _is_placed(pg: PlacementGroup) -> bool:
    return placement_group_table(pg).get("state") == "CREATED"


def _wait_placed(
    pgs: list[PlacementGroup], timeout_s: float, give_up: Callable[[], bool] = lambda: False
) -> int:
    """Poll the GCS until every group is placed, ``timeout_s`` passed or ``give_up()``;
    how many are not. (Polled, not ``pg.ready()``: that runs a task in the group, a
    worker process each.)"""
    deadline = time.monotonic() + timeout_s
    waiting = list(pgs)
    while True:
        waiting = [pg for pg in waiting if not _is_placed(pg)]
        if not waiting or time.monotonic() >= deadline or give_up():
            return len(waiting)
        time.sleep(0.1)


def _node_order(slots: list[_Slot], driver_node: str) -> list[_Slot]:
    """Ranks numbered node by node: the frontend's node first, then by IP and node id
    (stable within a node)."""
    return sorted(slots, key=lambda s: (s.node_id != driver_node, s.node_ip, s.node_id))
