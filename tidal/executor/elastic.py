"""The worker side of elastic expert parallelism (docs/architecture.md#elastic-protocol): standby groups, expert
transfers, the swap and the expert install. The engine calls the ``@rpc`` methods here as
``elastic.<method>`` (docs/architecture.md#worker-rpc); helper-thread calls (1, 3) come
from the engine's elastic shell while the busy loop steps.

Per scale operation (epoch ``n`` = the new topology's), on each engine:

1. ``join_standby`` (helper thread): a TCPStore client to the frontend's fresh store, a
   wait until every participant has announced itself there (the part a rollback can
   interrupt), then the transfer group over the operation's participants (prefix ``e{n}/xfer``) and, for a
   member of the new topology, its DP and EP groups (``e{n}/dp``, ``e{n}/ep``). Same order
   on every engine (xfer first: a leaving engine creates only that one). With TP each
   worker joins them at its own place (``process_groups``: ``e{n}/dp.tp{t}``, and
   position * TP + t in the transfer and EP groups): experts move worker to worker.
2. ``pack_expert_sends`` (busy loop): a snapshot of every expert this engine sends, per
   MoE layer from the layer's *current* slots (EPLB may have re-placed layers
   differently, so an expert can be absent from some layers): an int64 ``[L]`` "held"
   flag per layer and one flat payload of the held layers' ``w13`` then ``w2`` rows.
3. ``transfer_experts`` (helper thread): every transfer involving this engine, in one
   global order (ascending ``(expert, dst_engine_id, dst_slot)``, unique per transfer
   and the same on every engine, so blocking pairwise send/recv cannot deadlock: the
   smallest pending transfer always has both its ends waiting on it). Per transfer the
   sender sends the flags then the payload (as bytes); the receiver stages the held
   layers and reads the others from the checkpoint (after the network loop, one pass
   over the files); a spec without a source is read from disk entirely. Staged:
   ``(decoder layer index, expert) -> (w13 [2I, H], w2 [H, I])`` on the CPU.
4. ``standby_barrier``: MAX of (wave, step) over the new DP group (every new member).
5. Commit, busy loop, at one step on every rank: ``swap_groups`` (the standby DP/EP
   groups become the current ones, the old ones retire, the transfer group goes),
   ``install_experts`` (every MoE layer takes its row of the new layout: kept experts,
   staged ones, disk for anything else; dispatchers and EPLB rebuilt on the new EP
   group), ``destroy_retired_groups``. A leaving engine calls ``leave_groups``.
6. Rollback: ``destroy_standby`` and ``discard_staged``; nothing current was touched.

Threads: the helper-thread calls touch only the standby entry and the staged experts of
their epoch; a lock guards the dicts. A ``destroy_standby`` while the helper is still in
a rendezvous or a transfer cancels that attempt: a wait for peers ends at once, what it
creates afterwards is destroyed and it raises, so a late helper can never leak a group or
stage into a later attempt of the same epoch (a rolled-back operation's epoch is reused
by the next one).
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ReduceOp, TCPStore

from tidal.config import EngineConfig
from tidal.distributed.collectives import CollectiveControl
from tidal.distributed.groups import StatelessGroup
from tidal.executor.model_runner import ModelRunner, num_experts
from tidal.executor.process_groups import WorkerGroups, dp_prefix, worker_rank
from tidal.executor.rpc import Reduce, rpc
from tidal.kernels.host_memory import release_free_heap
from tidal.models.loader import load_expert_weights
from tidal.moe.placement import ExpertPlacement
from tidal.protocol.elastic import ExpertTransferSpec
from tidal.protocol.topology import Topology

logger = logging.getLogger(__name__)

_TAG_FLAGS = 1
_TAG_PAYLOAD = 2

TransferKey = tuple[int, int, int, int]  # (expert, dst_engine_id, dst_tp_rank, dst_slot)
# (layer index, expert) -> w13, w2 (+ their FP8 row scales): FusedMoE.expert_weights' form
Staged = dict[tuple[int, int], tuple[Tensor, ...]]


def transfer_key(spec: ExpertTransferSpec) -> TransferKey:
    """Unique per transfer of a plan and the same on every engine: the global order."""
    return (spec.expert, spec.dst_engine_id, spec.dst_tp_rank, spec.dst_slot)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"store address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


# How often a helper waiting for its peers looks at the store (one small request each).
_ARRIVAL_POLL_S = 0.05


@dataclass(eq=False)
class _Standby:
    """One attempt's standby groups of an epoch (a retry of the epoch is a new object)."""

    epoch: int
    members: list[int]
    participants: list[int]
    store: Any = None
    xfer: StatelessGroup | None = None
    dp: StatelessGroup | None = None
    ep: StatelessGroup | None = None
    # Set by destroy_standby (a rollback): wakes a helper waiting for its peers.
    cancel_event: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def cancel(self) -> None:
        self.cancel_event.set()

    def destroy(self) -> None:
        for g in (self.ep, self.dp, self.xfer):
            if g is not None:
                g.destroy()
        self.ep = self.dp = self.xfer = None
        self.store = None


def _await_participants(
    entry: _Standby,
    store: Any,
    engine_id: int,
    timeout_s: float,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> None:
    """Announce this worker (engine ``engine_id``, TP rank ``tp_rank``) in the operation's
    store, then wait until every worker of every participant has: the groups' rendezvous
    (gloo's, inside its constructor) cannot be interrupted, so the wait for a peer that
    may never come happens here, where a cancellation (``destroy_standby``: a rollback)
    ends it at once and the deadline names who is missing. The store is fresh per
    operation, so no key outlives its attempt."""

    def key(e: int, t: int) -> str:
        return f"tidal/e{entry.epoch}/arrived/{e}.{t}"

    store.set(key(engine_id, tp_rank), b"1")
    keys = [key(e, t) for e in entry.participants for t in range(tp_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if entry.cancel_event.wait(_ARRIVAL_POLL_S):
            raise RuntimeError(f"the standby groups of epoch {entry.epoch} were destroyed")
        if time.monotonic() > deadline:
            missing = sorted(
                {
                    e
                    for e in entry.participants
                    for t in range(tp_size)
                    if not store.check([key(e, t)])
                }
            )
            raise TimeoutError(
                f"standby rendezvous of epoch {entry.epoch} timed out after {timeout_s:g} s "
                f"waiting for engines {missing}"
            )


class ElasticWorkerState:
    """Elastic-EP state of one worker. ``Worker`` builds it with what it works on: the
    config, the device, the runner (its model and its groups) and the groups holder it
    swaps."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        runner: ModelRunner,
        groups: WorkerGroups,
        collectives: CollectiveControl,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.config = config
        # The worker's abort flags: the standby DP/EP groups serve after the commit.
        self.collectives = collectives
        self.device = device
        self.runner = runner
        self.groups = groups
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._lock = threading.Lock()
        self._standby: dict[int, _Standby] = {}
        self._packed: dict[int, dict[TransferKey, tuple[Tensor, Tensor]]] = {}
        self._staged: dict[int, Staged] = {}
        self._retired: list[Any] = []  # old groups (and their store) after a swap
        # Epoch of the current groups (None: none yet, e.g. a joining engine).
        self.epoch: int | None = None
        # False on a joining engine until install_experts: its expert slots are allocated
        # but hold nothing yet, so none of them may be "kept".
        self.experts_valid = True

    # ---------------------------------------------------------------- startup

    def init_joiner(self, topology: Topology, engine_id: int) -> None:
        if topology.placement is None:
            raise ValueError("a joining engine needs the new topology's expert placement")
        runner = self.runner
        rank = worker_rank(topology.rank_of(engine_id), self.tp_rank, self.tp_size)
        placement = ExpertPlacement.from_layout(num_experts(runner.config), topology.placement)
        runner.load_model(placement.local_expert_ids(rank), load_experts=False)
        runner.placement = placement
        self.experts_valid = False
        logger.info(
            "engine %d: joining epoch %d as rank %d with experts %s (weights not loaded yet)",
            engine_id,
            topology.epoch,
            rank,
            placement.local_expert_ids(rank),
        )

    # ---------------------------------------------------------------- standby groups

    @rpc()
    def join_standby(
        self,
        epoch: int,
        store_address: str,
        members: list[int],
        participants: list[int],
        engine_id: int,
        timeout_s: float,
    ) -> None:
        """Helper thread: create the standby groups of ``epoch`` on the TCPStore at
        ``store_address``: DP and EP over ``members`` (rank = position) if this engine is
        one, and the transfer group over ``participants``. Blocks until all have joined."""
        if engine_id not in participants:
            raise ValueError(f"engine {engine_id} is not a participant of epoch {epoch}")
        host, port = parse_address(store_address)
        entry = _Standby(epoch, list(members), list(participants))
        with self._lock:
            stale = self._standby.pop(epoch, None)
            self._standby[epoch] = entry
        if stale is not None:
            logger.warning(
                "engine %d: replacing stale standby groups of epoch %d", engine_id, epoch
            )
            stale.cancel()
            stale.destroy()
        try:
            store = TCPStore(
                host,
                port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            self._attach(entry, "store", store)
            _await_participants(entry, store, engine_id, timeout_s, self.tp_rank, self.tp_size)

            tp = self.tp_size

            def create(name: str, prefix: str, rank: int, world: int, backend: str) -> None:
                # The DP and EP groups serve after the commit: abortable like the launch
                # ones (the transfer group runs on a helper thread with its own deadline).
                serving = name != "xfer"
                group = StatelessGroup.create(
                    host=host,
                    port=0,
                    rank=rank,
                    world_size=world,
                    backend=backend,
                    store=store,
                    prefix=f"e{epoch}/{prefix}",
                    timeout_s=timeout_s,
                    control=self.collectives if serving else None,
                    epoch=epoch if serving else None,
                )
                self._attach(entry, name, group)

            # Every worker of every participant / member (rank: position * TP + t).
            parts, members = entry.participants, entry.members
            t = self.tp_rank
            create(
                "xfer", "xfer", worker_rank(parts.index(engine_id), t, tp), len(parts) * tp, "gloo"
            )
            if engine_id in members:
                position = members.index(engine_id)
                create("dp", dp_prefix(t), position, len(members), "gloo")
                if self.config.parallel.enable_expert_parallel:
                    device = self.device
                    if device.type == "cuda":
                        torch.cuda.set_device(device)  # per thread: this helper's
                    backend = "nccl" if device.type == "cuda" else "gloo"
                    create("ep", "ep", worker_rank(position, t, tp), len(members) * tp, backend)
        except BaseException:
            with self._lock:
                if self._standby.get(epoch) is entry:
                    del self._standby[epoch]
            entry.destroy()
            raise
        logger.info(
            "engine %d: joined the standby groups of epoch %d (members %s, participants %s)",
            engine_id,
            epoch,
            entry.members,
            entry.participants,
        )

    def _attach(self, entry: _Standby, name: str, obj: Any) -> None:
        """Keep what the helper created, unless the attempt was cancelled meanwhile."""
        with self._lock:
            if not entry.cancelled:
                setattr(entry, name, obj)
                return
        if isinstance(obj, StatelessGroup):
            obj.destroy()
        raise RuntimeError(f"the standby groups of epoch {entry.epoch} were destroyed")

    @rpc(timeout_s=60.0)  # cleans up after a failure: bounded
    def destroy_standby(self, epoch: int) -> None:
        """Destroy whatever standby groups of ``epoch`` exist (idempotent, no peers)."""
        with self._lock:
            entry = self._standby.pop(epoch, None)
            if entry is not None:
                entry.cancel()
        if entry is not None:
            entry.destroy()

    # ---------------------------------------------------------------- transfers

    @rpc()
    @torch.no_grad()
    def pack_expert_sends(self, epoch: int, sends: list[ExpertTransferSpec]) -> None:
        """Busy-loop thread: snapshot the weights of the experts this engine sends (so the
        helper never reads a slot an EPLB move is rewriting)."""
        layers = self.runner.model.moe_layers()
        packed: dict[TransferKey, tuple[Tensor, Tensor]] = {}  # flags [L] int64, bytes
        for spec in sends:
            if spec.src_tp_rank != self.tp_rank:
                continue  # another worker of this engine sends it
            flags = torch.zeros(len(layers), dtype=torch.int64)
            parts: list[Tensor] = []
            for li, moe in enumerate(layers):
                if not self.experts_valid or spec.expert not in moe.local_expert_ids:
                    continue
                slot = moe.local_expert_ids.index(spec.expert)
                flags[li] = 1
                # From whichever layout holds it (a packed path's is the only copy); as
                # bytes: FP8 weights travel with their float32 scales.
                parts += [p.reshape(-1).view(torch.uint8) for p in moe.expert_weights([slot])]
            # cat copies: the snapshot never aliases a slot an EPLB move may rewrite.
            payload = torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)
            packed[transfer_key(spec)] = (flags, payload)
        with self._lock:
            self._packed.setdefault(epoch, {}).update(packed)

    @rpc(Reduce.SUM)  # each worker moves its own experts: the rank received the sum
    @torch.no_grad()
    def transfer_experts(
        self,
        epoch: int,
        sends: list[ExpertTransferSpec],
        receives: list[ExpertTransferSpec],
        engine_id: int,
        timeout_s: float,
    ) -> int:
        """Helper thread: send the packed experts and receive (stage) ``receives``, peer to
        peer over the transfer group, from disk where the source is None. Every engine
        walks the transfers in list order. Returns the bytes received (network + disk)."""
        with self._lock:
            entry = self._standby.get(epoch)
            packed = dict(self._packed.get(epoch, {}))
        if entry is None or entry.xfer is None:
            raise RuntimeError(f"engine {engine_id}: no transfer group of epoch {epoch}")
        group, participants = entry.xfer, entry.participants
        tp, me = self.tp_size, (engine_id, self.tp_rank)

        def peer(engine: int, tp_rank: int) -> int:  # rank in the transfer group
            return worker_rank(participants.index(engine), tp_rank, tp)

        runner = self.runner
        model = runner.model
        layer_ids = model.moe_layer_ids()
        layers = model.moe_layers()
        specs = layers[0].expert_part_specs()  # one expert's tensors, read without the weights
        nbytes_of = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
        per_expert = sum(nbytes_of)
        deadline = time.monotonic() + timeout_s

        def wait(work: Any, what: str) -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"expert transfer of epoch {epoch} timed out ({what})")
            work.wait(datetime.timedelta(seconds=left))

        staged: Staged = {}
        from_disk: dict[int, list[int]] = {}
        todo = {transfer_key(s): s for s in [*sends, *receives]}
        for key in sorted(todo):
            spec = todo[key]
            src, dst = spec.src_engine_id, spec.dst_engine_id
            src_w, dst_w = (src, spec.src_tp_rank), (dst, spec.dst_tp_rank)
            if src_w == me and dst_w != me:
                flags, payload = packed.get(key) or (None, None)
                if flags is None:
                    logger.warning(
                        "engine %d: expert %d to engine %d was not packed; the receiver "
                        "reads it from disk",
                        engine_id,
                        spec.expert,
                        dst,
                    )
                    flags, payload = torch.zeros(len(layers), dtype=torch.int64), None
                to = peer(*dst_w)
                wait(group.process_group.send([flags], to, _TAG_FLAGS), f"send to {dst}")
                if int(flags.sum()) and payload is not None:  # None: nothing packed (all zero)
                    data = payload.contiguous()
                    wait(group.process_group.send([data], to, _TAG_PAYLOAD), f"send to {dst}")
                continue
            if dst_w != me:
                continue  # not this worker's
            if src is None or (src_w == me and key not in packed):
                flags = torch.zeros(len(layers), dtype=torch.int64)  # all from disk
                payload = torch.empty(0, dtype=torch.uint8)
            elif src_w == me:  # a copy to itself (plans make these slot moves)
                flags, payload = packed[key]
            else:
                frm = peer(src, spec.src_tp_rank)  # src is not None here
                flags = torch.empty(len(layers), dtype=torch.int64)
                wait(group.process_group.recv([flags], frm, _TAG_FLAGS), f"recv from {src}")
                held = int(flags.sum())
                payload = torch.empty(held * per_expert, dtype=torch.uint8)
                if held:
                    wait(group.process_group.recv([payload], frm, _TAG_PAYLOAD), f"recv from {src}")
            offset = 0
            for li, lid in enumerate(layer_ids):
                if not int(flags[li]):
                    from_disk.setdefault(lid, []).append(spec.expert)
                    continue
                pieces = payload[offset : offset + per_expert].split(nbytes_of)
                offset += per_expert
                staged[lid, spec.expert] = tuple(
                    _as_tensor(piece, shape, dtype) for piece, (shape, dtype) in zip(pieces, specs)
                )
        if from_disk:
            staged.update(load_expert_weights(model, self.config.model.model, from_disk))
        nbytes = sum(t.nbytes for parts in staged.values() for t in parts)
        with self._lock:
            if entry.cancelled:
                raise RuntimeError(f"the standby groups of epoch {epoch} were destroyed")
            self._staged.setdefault(epoch, {}).update(staged)
        logger.info(
            "engine %d: epoch %d transfers done: %d sent, %d staged (%d layer(s) from disk), "
            "%d bytes",
            engine_id,
            epoch,
            sum(1 for s in todo.values() if (s.src_engine_id, s.src_tp_rank) == me),
            len({e for _, e in staged}),
            sum(len(v) for v in from_disk.values()),
            nbytes,
        )
        return nbytes

    @rpc(timeout_s=60.0)  # cleans up after a failure: bounded
    def discard_staged(self, epoch: int) -> None:
        """Rollback: drop what was packed and staged for ``epoch``."""
        self._drop_staged(epoch)
        self._release_heap()

    def _drop_staged(self, epoch: int) -> None:
        with self._lock:
            self._staged.pop(epoch, None)
            self._packed.pop(epoch, None)

    def _release_heap(self) -> None:
        """The end of a scale operation (committed: old groups gone; rolled back: staged
        experts dropped). What it freed (transfer buffers, old packs) stays resident in
        glibc's arenas: on a DP=2 rank of the default model each 2 -> 3 -> 2 cycle left
        ~40 MB there (833 -> 792 MB once trimmed)."""
        if self.device.type == "cpu":
            release_free_heap()

    # ---------------------------------------------------------------- commit

    @rpc(Reduce.FIRST)  # every worker's own dp.tp{t} group; they agree
    def standby_barrier(self, epoch: int, wave: int, step: int) -> tuple[int, int]:
        """The first collective of the standby DP group of ``epoch``: MAX of (wave, step)."""
        with self._lock:
            entry = self._standby.get(epoch)
        group = entry.dp if entry is not None else None
        if group is None and self.epoch == epoch:
            group = self.groups.dp  # swapped in already: the standby is current
        if group is None:
            raise RuntimeError(f"no DP group of epoch {epoch} (standby or current)")
        t = group.all_reduce(torch.tensor([wave, step], dtype=torch.int64), ReduceOp.MAX)
        return int(t[0]), int(t[1])

    @rpc()
    def swap_groups(self, epoch: int) -> None:
        """The standby DP/EP groups of ``epoch`` become the current ones (the old ones are
        kept until ``destroy_retired_groups``); the transfer group is destroyed."""
        with self._lock:
            entry = self._standby.get(epoch)
            if entry is None or entry.dp is None:
                raise RuntimeError(f"no standby DP group of epoch {epoch} to swap in")
            if self.config.parallel.enable_expert_parallel and entry.ep is None:
                raise RuntimeError(f"no standby EP group of epoch {epoch} to swap in")
            del self._standby[epoch]
        g = self.groups
        self._retired += g.take()
        if entry.xfer is not None:
            entry.xfer.destroy()
        g.dp, g.ep, g.store = entry.dp, entry.ep, entry.store
        self.runner.set_process_groups(entry.dp, entry.ep)
        self.epoch = epoch
        logger.info("swapped in the groups of epoch %d (DP rank %d)", epoch, entry.dp.rank)

    @rpc()
    @torch.no_grad()
    def install_experts(self, epoch: int, layout: list[list[int]], position: int) -> None:
        """``layout``: one row per worker of the new topology; ``position``: this engine's
        place there (its workers take rows ``position * TP + t``)."""
        runner = self.runner
        model = runner.model
        rank = worker_rank(position, self.tp_rank, self.tp_size)
        placement = ExpertPlacement.from_layout(num_experts(runner.config), layout)
        if not 0 <= rank < placement.ep_size:
            raise ValueError(f"rank {rank} is outside the layout's {placement.ep_size} ranks")
        ep = runner.ep_group
        if ep is not None and (ep.rank != rank or ep.world_size != placement.ep_size):
            raise ValueError(
                f"layout rank {rank}/{placement.ep_size} does not match the EP group "
                f"(rank {ep.rank}/{ep.world_size})"
            )
        new_ids = placement.local_expert_ids(rank)
        with self._lock:
            staged = dict(self._staged.get(epoch, {}))
        layer_ids, layers = model.moe_layer_ids(), model.moe_layers()

        def held(moe: Any) -> dict[int, int]:
            if not self.experts_valid:
                return {}
            return {e: s for s, e in enumerate(moe.local_expert_ids)}

        missing: dict[int, list[int]] = {}
        for lid, moe in zip(layer_ids, layers):
            have = held(moe)
            miss = [e for e in new_ids if e not in have and (lid, e) not in staged]
            if miss:
                missing[lid] = miss
        if missing:
            logger.warning(
                "epoch %d: experts neither held nor staged, read from disk: %s", epoch, missing
            )
            staged.update(load_expert_weights(model, self.config.model.model, missing))
        for lid, moe in zip(layer_ids, layers):
            have = held(moe)
            dev = moe.expert_map.device
            kept = [e for e in new_ids if e in have]
            own = moe.expert_weights([have[e] for e in kept])  # copies: w13, w2 (+ scales)
            mine = {e: i for i, e in enumerate(kept)}
            per_slot = [
                [t[mine[e]] for t in own] if e in have else [t.to(dev) for t in staged[lid, e]]
                for e in new_ids
            ]
            # stack copies: every source is read before a slot is written.
            new = [torch.stack(list(ts)) for ts in zip(*per_slot)]
            moe.set_local_experts(new_ids)  # keeps the backend's storage layout
            moe.set_expert_weights(new)
        runner.placement = placement
        if ep is not None:
            runner.setup_expert_parallel(placement)
        self.experts_valid = True
        self._drop_staged(epoch)
        logger.info("epoch %d: rank %d installed experts %s", epoch, rank, new_ids)

    @rpc(timeout_s=60.0)  # cleans up after a failure: bounded
    def destroy_retired_groups(self) -> None:
        """Survivor after a swap: destroy the old epoch's groups."""
        self._destroy_retired()
        self._release_heap()

    def _destroy_retired(self) -> None:
        retired, self._retired = self._retired, []
        for g in retired:
            if isinstance(g, StatelessGroup):
                g.destroy()

    @rpc()
    def leave_groups(self) -> None:
        """A leaving engine at the commit: its current groups go, and with them whatever
        it still has of the operation (the transfer group) and of earlier epochs."""
        self.groups.destroy()
        self.runner.set_process_groups(None, None)
        for epoch in self.standby_epochs():
            self.destroy_standby(epoch)
        self._destroy_retired()
        self.epoch = None

    def abandon_groups(self) -> None:
        """A collective of the current groups failed (a member died, docs/architecture.md#faults):
        destroy them now, so a peer blocked on this rank fails at once instead of at its
        timeout. The epoch stays (the recovery's PREPARE is for epoch + 1), and so do the
        experts and any standby groups: the recovery builds on them."""
        g = self.groups
        for group in (g.ep, g.dp):
            if group is not None:
                group.destroy()
        self._retired += g.take()
        self.runner.set_process_groups(None, None)

    def shutdown(self) -> None:
        """Destroy every standby and retired group, drop staged experts (no peers)."""
        with self._lock:
            entries = list(self._standby.values())
            self._standby.clear()
            for entry in entries:
                entry.cancel()
            self._staged.clear()
            self._packed.clear()
        for entry in entries:
            entry.destroy()
        self._destroy_retired()

    def standby_epochs(self) -> list[int]:
        with self._lock:
            return sorted(self._standby)


def _as_tensor(raw: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Bytes ``raw`` (a piece of a received payload) as ``shape`` of ``dtype``; copied
    when its offset is not aligned to ``dtype`` (a view needs that)."""
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(shape)
