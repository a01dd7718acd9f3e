"""Stateless process groups: torch.distributed collectives without the global default group.

Why not ``torch.distributed.init_process_group``? It creates one process-wide default
group that cannot be re-created with a different world size while the old one is alive.
Elastic EP needs the opposite: the serving group and a *standby* group for the new size
coexist during prepare, then the old one is destroyed at commit, and the cycle repeats.
So each ``StatelessGroup`` owns its own c10d backend object, built directly on a
``TCPStore`` (through a ``PrefixStore`` so several groups can share one store), and is
never registered in torch's global world (``torch.distributed.is_initialized()`` stays
False).

Backends:
- ``gloo``: CPU tensors. Always available; used for the DP consensus all-reduce and for the
  EP group on CPU.
- ``nccl``: CUDA tensors, when torch is built with NCCL. The caller pins the device
  (``torch.cuda.set_device``) before ``create``. Not exercised by the CPU test suite.

Collectives call the backend object directly (``backend.allreduce([t], opts).wait()``);
every one is synchronous and blocks at most ``timeout_s`` before raising ``GroupFailure``
(a ``RuntimeError``): a peer that died, a timeout, or a group destroyed under the caller.
The engine tells that apart from its own bugs by the type: a ``GroupFailure`` is a rank
death to recover from (docs/architecture.md#faults), anything else is fatal. A group created with
``failure=LocalGroupFailure`` (the tensor-parallel group inside one rank) raises that
instead: its peers are this rank's own workers, so its failure is this rank's death.

Abortable waits (a group made with a ``CollectiveControl`` and an epoch, gloo): a peer
that froze without closing its sockets would keep a collective waiting for ``timeout_s``.
Such a group waits in slices of ``WAIT_SLICE_S`` and between two asks its control whether
its epoch was aborted (a recovery replaces it); then the wait ends with ``GroupFailure``
at once. (Gloo's reduce-scatter runs inside ``Work.wait()``, whose timeout it ignores:
such a group reduce-scatters with an all-to-all and a local reduction instead.) The
abandoned operation still runs in gloo's worker thread until its peers or its timeout
end it: it may still write its *output* later, so an aborted in-place
collective works on a private copy (its caller's tensor is never written after the
failure), and the backend is released on a thread of its own (releasing a gloo backend
joins its worker thread, which would block the caller until then).
On torch 2.13 gloo natively supports all-gather, reduce-scatter (``_reduce_scatter_base``)
and uneven all-to-all (``alltoall_base``) on CPU; where a build lacks reduce-scatter we fall
back to all-reduce + slice (costs ``world_size`` times the reduce-scatter traffic).

Waiting on peers (``CollectiveControl``): a group made with a control tells it when the
calling thread waits on its peers, whatever the backend -- a gloo wait while it runs, an
NCCL collective as one the device may wait in (``CollectiveControl.enqueued``, with a
CUDA event recorded on the current stream before its wait: it completes when the
collective can start) -- so the stall watchdog never takes a rank that waits for a
stuck peer for the stuck one. On either backend a collective of an aborted epoch fails
before it starts; only gloo waits are abortable once started (an NCCL wait returns at
once).

A group is not thread-safe: use it from one thread (the engine busy loop).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ReduceOp, TCPStore

from tidal.distributed.collectives import CollectiveControl
from tidal.distributed.ports import listening_socket, local_address_towards

logger = logging.getLogger(__name__)


class GroupFailure(RuntimeError):
    """A collective of a ``StatelessGroup`` failed: a peer is gone (its sockets closed),
    the collective timed out, or the group was destroyed. The group is unusable."""


class LocalGroupFailure(RuntimeError):
    """A collective among this rank's own workers (its TP group) failed: a worker of this
    rank is gone, so the rank is (docs/architecture.md#faults). Not a ``GroupFailure``: nothing to
    recover inside the rank."""


# An abortable wait checks its control this often: how long a survivor may stay in a
# collective after a recovery aborted it.
WAIT_SLICE_S = 0.05
_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)


def _wait(work: Any, prefix: str, failure: type[RuntimeError] = GroupFailure) -> None:
    """Wait for a backend ``Work``; its failure becomes a ``failure``."""
    try:
        work.wait()
    except (GroupFailure, LocalGroupFailure):
        raise
    except RuntimeError as e:  # gloo/NCCL errors (DistBackendError is one)
        raise failure(f"collective on group {prefix!r} failed: {e}") from e


def _release_later(holder: list[Any]) -> None:
    """Drop the references in ``holder`` -- the last ones to a backend with an abandoned
    operation -- on a thread of its own: releasing it joins gloo's worker thread, which
    returns only when that operation ends (its peers, or its timeout). The caller must
    hold no other reference to them (not even a local variable)."""
    threading.Thread(target=holder.clear, name="group-release", daemon=True).start()


_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The reductions an abortable reduce-scatter does locally (``_reduce_scatter_via_all_to_all``).
# ``ReduceOp.SUM`` and friends are ``RedOpType`` members; the options take a ``ReduceOp``.
RedOp = ReduceOp.RedOpType
_LOCAL_REDUCE = {ReduceOp.SUM: torch.sum, ReduceOp.MAX: torch.amax}
_BACKENDS = ("gloo", "nccl")


def create_store(
    host: str, port: int, *, rank: int, world_size: int, timeout_s: float = 60.0
) -> TCPStore:
    """Rank 0 hosts the store (``serve_store``); the others connect to ``host:port``.

    Does not wait for all workers, so rank 0 returns at once; the group's rendezvous
    (inside the backend constructor) is what blocks until every rank has arrived.
    """
    if rank == 0:
        return serve_store(host, port, world_size=world_size, timeout_s=timeout_s)
    return _tcp_store(host, port, world_size, timeout_s, is_master=False)


def serve_store(
    host: str, port: int = 0, *, world_size: int | None = None, timeout_s: float = 60.0
) -> TCPStore:
    """A TCPStore server listening on ``host`` only (port 0: a free one, ``store.port``).

    torch's own server listens on every interface (``*:port``) whatever ``host`` says,
    which would open the rendezvous of a loopback-only deployment to the network. So the
    listening socket is made here, bound to ``host``, and handed over (the store owns
    and closes it)."""
    sock = listening_socket(host, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()
    return _tcp_store(
        host, bound_port, world_size, timeout_s, is_master=True, master_listen_fd=fd, use_libuv=True
    )


def _tcp_store(
    host: str, port: int, world_size: int | None, timeout_s: float, **kwargs: Any
) -> TCPStore:
    timeout = datetime.timedelta(seconds=timeout_s)
    return TCPStore(host, port, world_size, timeout=timeout, wait_for_workers=False, **kwargs)


class StatelessGroup:
    """A c10d process group of ``world_size`` ranks that lives outside torch's global state.

    Build with ``StatelessGroup.create(...)`` on every member; tear down with ``destroy()``.
    Tensors passed to collectives must live on the backend's device (CPU for gloo, the
    current CUDA device for nccl) and are made contiguous where needed.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        backend_name: str,
        backend: Any,
        process_group: dist.ProcessGroup,
        store: TCPStore,
        owns_store: bool,
        prefix: str,
        failure: type[RuntimeError] = GroupFailure,
        control: CollectiveControl | None = None,
        epoch: int | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend_name = backend_name
        self.prefix = prefix
        self.epoch = epoch
        self._backend: Any = backend  # None once destroyed (``_check_alive`` guards)
        self._pg: Any = process_group
        self._store: TCPStore | None = store
        self._owns_store = owns_store
        self._native_reduce_scatter = True
        self._destroyed = False
        self._failure = failure
        self._control = control
        # Abortable waits: gloo only (an NCCL wait returns at once; the device waits).
        self._abortable = control is not None and backend_name == "gloo"
        self._abandoned: Any = None  # the work of an aborted wait, still running in gloo

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        store: TCPStore | None = None,
        prefix: str = "",
        timeout_s: float = 60.0,
        local_addr: str | None = None,
        failure: type[RuntimeError] = GroupFailure,
        control: CollectiveControl | None = None,
        epoch: int | None = None,
    ) -> StatelessGroup:
        """Create the group on this rank; blocks until all ``world_size`` ranks have joined.

        host/port: the TCPStore address (rank 0 hosts it) unless ``store`` is given, in which
            case port is ignored and the caller keeps ownership of the store (``host``
            still picks the default ``local_addr``).
        prefix: namespace of this group's keys in the store. Must be unique per store:
            groups sharing a store (or re-created on it) need distinct prefixes.
        local_addr: the address gloo binds for its peer connections; default 127.0.0.1
            when ``host`` is loopback, else this machine's address on the route to ``host``
            (``host`` itself on the host that serves the store).
        failure: what a failed collective raises (``LocalGroupFailure`` for a rank's TP group).
        control, epoch: make waits abortable (module docstring): ``control.abort`` of an
            epoch above ``epoch`` ends them.
        """
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}; got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        owns_store = store is None
        if store is None:
            store = create_store(host, port, rank=rank, world_size=world_size, timeout_s=timeout_s)
        pstore = PrefixStore(f"tidal/{prefix}/", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            be, btype, device = _make_gloo(pstore, rank, world_size, timeout, host, local_addr)
        else:
            be, btype, device = _make_nccl(pstore, rank, world_size, timeout)
        pg = dist.ProcessGroup(pstore, rank, world_size)
        pg._set_default_backend(btype)
        pg._register_backend(device, btype, be)
        return cls(
            rank=rank,
            world_size=world_size,
            backend_name=backend,
            backend=be,
            process_group=pg,
            store=store,
            owns_store=owns_store,
            prefix=prefix,
            failure=failure,
            control=control,
            epoch=epoch,
        )

    @property
    def process_group(self) -> dist.ProcessGroup:
        """A ``torch.distributed.ProcessGroup`` view, for libraries that need one (DeepEP,
        ``dist.all_gather_object``). It is not registered in torch's global world."""
        self._check_alive()
        return self._pg

    @property
    def store(self) -> TCPStore | None:
        return self._store

    @property
    def is_destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """Release the backend (its peer sockets) and, if this group created it, the store.

        Idempotent and non-blocking: it does not wait for peers, so a rank can leave a
        group whose other members are dead. Callers that need all ranks to finish their
        collectives first call ``barrier()`` before ``destroy()``.
        """
        if self._destroyed:
            return
        self._destroyed = True
        if self._control is not None:
            self._control.drop(id(self))
        try:
            self._backend.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort: peers may already be gone
            logger.debug("group %r shutdown: %s", self.prefix, e)
        if self._abandoned is not None:  # see the module docstring: never block here
            holder = [self._backend, self._pg, self._abandoned]
            self._backend = self._pg = self._abandoned = None
            _release_later(holder)
        self._backend = None
        self._pg = None
        # Dropping our reference closes a store we created (server on rank 0, client
        # elsewhere); a store passed in by the caller stays alive through theirs.
        self._store = None

    def _check_alive(self) -> None:
        if self._destroyed:
            raise self._failure(f"process group {self.prefix!r} was destroyed")
        if self._control is not None:
            cause = self._control.aborted(self.epoch)
            if cause is not None:
                raise self._failure(f"collective on group {self.prefix!r} aborted: {cause}")

    @property
    def abortable(self) -> bool:
        return self._abortable

    def _private(self, t: torch.Tensor) -> torch.Tensor:
        """The buffer an in-place collective writes: ``t`` itself, or a copy when the
        wait may be aborted (an abandoned operation may still write it later) or ``t``
        is not contiguous. The caller copies it back on success."""
        if self._abortable or not t.is_contiguous():
            return t.clone(memory_format=torch.contiguous_format)
        return t

    def _wait(self, work: Any) -> None:
        """Wait for ``work``; a failure, or an abort of this group's epoch meanwhile,
        raises ``GroupFailure`` (``LocalGroupFailure`` for a TP group)."""
        control = self._control
        if control is None:
            _wait(work, self.prefix, self._failure)
            return
        if not self._abortable:
            # A device backend: ``wait`` orders the current stream after the collective
            # and returns; how long the device waits on the peers, the control learns.
            reached = _device_mark()
            _wait(work, self.prefix, self._failure)
            control.enqueued(id(self), reached, work)
            return
        with control.waiting():
            while True:
                try:
                    work.wait(_SLICE)
                    return
                except RuntimeError:
                    if work.is_completed():
                        # Ended between the slice's timeout and this check (a loaded
                        # machine widens that window): a wait now returns at once if it
                        # succeeded, else raises its own failure (a peer gone, gloo's
                        # timeout). The slice's "timed out" is not a failure.
                        _wait(work, self.prefix, self._failure)
                        return
                cause = control.aborted(self.epoch)  # only the slice ran out
                if cause is not None:
                    self._abandoned = work
                    raise self._failure(f"collective on group {self.prefix!r} aborted: {cause}")

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, op: RedOp = ReduceOp.SUM) -> torch.Tensor:
        """In place over all ranks; returns ``t``."""
        self._check_alive()
        buf = self._private(t)
        opts = dist.AllreduceOptions()
        opts.reduceOp = ReduceOp(op)
        self._wait(self._backend.allreduce([buf], opts))
        if buf is not t:
            t.copy_(buf)
        return t

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """``out [W*n, ...]`` <- concat over ranks of ``inp [n, ...]`` (rank order)."""
        self._check_alive()
        if out.shape[0] != self.world_size * inp.shape[0] or out.shape[1:] != inp.shape[1:]:
            raise ValueError(f"all_gather_into: out {tuple(out.shape)} vs inp {tuple(inp.shape)}")
        if out.numel() == 0:
            return out
        self._wait(self._backend._allgather_base(out, inp.contiguous()))
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concat over ranks along dim 0 of equal-shaped ``t``: ``[W*n, ...]``."""
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        return self.all_gather_into(out, t)

    def all_gather_v(self, t: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Variable rows per rank (``sizes[r]`` rows on rank r, agreed beforehand): pads to
        ``max(sizes)``, gathers, and returns the ``[sum(sizes), ...]`` concatenation."""
        sizes = list(sizes)
        if t.shape[0] != sizes[self.rank]:
            raise ValueError(f"all_gather_v: rank {self.rank} has {t.shape[0]} rows, sizes={sizes}")
        m = max(sizes)
        padded = _pad_rows(t, m)
        full = self.all_gather(padded).view(self.world_size, m, *t.shape[1:])
        return torch.cat([full[r, : sizes[r]] for r in range(self.world_size)])

    def reduce_scatter_into(
        self, out: torch.Tensor, inp: torch.Tensor, op: RedOp = ReduceOp.SUM
    ) -> torch.Tensor:
        """``out [n, ...]`` <- reduction over ranks of rows ``[rank*n, (rank+1)*n)`` of ``inp [W*n, ...]``."""
        self._check_alive()
        if inp.shape[0] != self.world_size * out.shape[0] or out.shape[1:] != inp.shape[1:]:
            raise ValueError(
                f"reduce_scatter_into: out {tuple(out.shape)} vs inp {tuple(inp.shape)}"
            )
        if inp.numel() == 0:
            return out
        inp = inp.contiguous()
        if self._abortable and op in _LOCAL_REDUCE:
            return self._reduce_scatter_via_all_to_all(out, inp, op)
        if self._native_reduce_scatter:
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = ReduceOp(op)
            try:
                self._wait(self._backend._reduce_scatter_base(out, inp, opts))
                return out
            except RuntimeError as e:
                if "support" not in str(e):
                    raise
                logger.info("native reduce_scatter unavailable (%s); using all_reduce + slice", e)
                self._native_reduce_scatter = False
        return self._reduce_scatter_via_all_reduce(out, inp, op)

    def _reduce_scatter_via_all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, op: RedOp
    ) -> torch.Tensor:
        """Abortable groups: gloo's native reduce-scatter runs inside ``Work.wait()``,
        which ignores its timeout, so no slice could end it. An all-to-all moves the same
        bytes (rank r gets every rank's block r), then the blocks are reduced here, in
        rank order."""
        recv = torch.empty_like(inp)  # [W*n, ...]: block j is rank j's block for us
        self._wait(self._backend.alltoall_base(recv, inp, [], []))
        blocks = recv.view(self.world_size, *out.shape)
        _LOCAL_REDUCE[op](blocks, dim=0, out=out)
        return out

    def _reduce_scatter_via_all_reduce(
        self, out: torch.Tensor, inp: torch.Tensor, op: RedOp = ReduceOp.SUM
    ) -> torch.Tensor:
        """Slow reference: all-reduce the whole input, keep this rank's slice.
        Moves ``W`` times the bytes of a real reduce-scatter."""
        n = out.shape[0]
        full = self.all_reduce(inp.clone(), op)
        out.copy_(full[self.rank * n : (self.rank + 1) * n])
        return out

    def reduce_scatter(self, inp: torch.Tensor, op: RedOp = ReduceOp.SUM) -> torch.Tensor:
        if inp.shape[0] % self.world_size:
            raise ValueError(
                f"reduce_scatter: {inp.shape[0]} rows not divisible by {self.world_size}"
            )
        out = inp.new_empty((inp.shape[0] // self.world_size, *inp.shape[1:]))
        return self.reduce_scatter_into(out, inp, op)

    def reduce_scatter_v(self, inp: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Sum-reduce ``inp [sum(sizes), ...]`` (same layout on every rank) and return this
        rank's ``sizes[rank]`` rows; pads each rank's block to ``max(sizes)``."""
        sizes = list(sizes)
        if inp.shape[0] != sum(sizes):
            raise ValueError(f"reduce_scatter_v: {inp.shape[0]} rows, sizes={sizes}")
        m = max(sizes)
        padded = inp.new_zeros((self.world_size, m, *inp.shape[1:]))
        start = 0
        for r, n in enumerate(sizes):
            padded[r, :n] = inp[start : start + n]
            start += n
        out = self.reduce_scatter(padded.view(self.world_size * m, *inp.shape[1:]))
        return out[: sizes[self.rank]]

    def all_to_all_single(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Rows ``in_splits[r]`` of ``inp`` go to rank r; ``out`` receives ``out_splits[r]``
        rows from rank r, in rank order. ``None`` splits mean equal splits along dim 0."""
        self._check_alive()
        in_splits = [] if in_splits is None else [int(x) for x in in_splits]
        out_splits = [] if out_splits is None else [int(x) for x in out_splits]
        if in_splits and sum(in_splits) != inp.shape[0]:
            raise ValueError(f"all_to_all_single: in_splits {in_splits} vs {inp.shape[0]} rows")
        if out_splits and sum(out_splits) != out.shape[0]:
            raise ValueError(f"all_to_all_single: out_splits {out_splits} vs {out.shape[0]} rows")
        self._wait(self._backend.alltoall_base(out, inp.contiguous(), out_splits, in_splits))
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """In place: every rank's ``t`` becomes rank ``src``'s."""
        self._check_alive()
        if not t.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor (it is written in place)")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        buf = self._private(t)
        self._wait(self._backend.broadcast([buf], opts))
        if buf is not t:
            t.copy_(buf)
        return t

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's equal-shaped ``t``, in rank order, on rank ``dst`` (None elsewhere)."""
        self._check_alive()
        opts = dist.GatherOptions()
        opts.rootRank = dst
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == dst else []
        self._wait(self._backend.gather([outs] if outs else [], [t], opts))
        return outs if self.rank == dst else None

    def barrier(self) -> None:
        self._check_alive()
        if self.backend_name == "gloo":
            self._wait(self._backend.barrier())
        else:  # NCCL's barrier needs a device hint; a 1-element all-reduce is equivalent
            self.all_reduce(
                torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
            )

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Point-to-point send (blocks until the peer has received, for gloo)."""
        self._check_alive()
        self._wait(self._backend.send([t.contiguous()], dst, tag))

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``t`` (shape and dtype agreed with the sender)."""
        self._check_alive()
        if not t.is_contiguous():
            raise ValueError("recv needs a contiguous tensor (it is written in place)")
        buf = self._private(t)
        self._wait(self._backend.recv([buf], src, tag))
        if buf is not t:
            t.copy_(buf)
        return t

    def all_gather_object(self, obj: Any, type: Any = Any) -> list[Any]:
        """Every rank's ``obj``, in rank order: small control data that msgspec can encode
        (builtins, msgspec Structs, dataclasses). Never pickle: a peer's bytes must not be
        able to run code here, so they are decoded as msgpack data, into ``type`` when
        given (which also validates them; ``msgspec.ValidationError`` otherwise).
        Two collectives: sizes, then the padded payloads.

        Encode errors (``TypeError`` for an object msgspec cannot encode) are raised
        before any collective, but only on the ranks whose object is bad; callers must
        send the same kind of object on every rank."""
        self._check_alive()
        device = self._device()
        encoded = msgspec.msgpack.encode(obj)
        payload = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device)
        sizes = self.all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=device))
        sizes_l = [int(s) for s in sizes.tolist()]
        data = self.all_gather_v(payload, sizes_l).cpu().numpy().tobytes()
        decoder = msgspec.msgpack.Decoder(type)
        out, start = [], 0
        for n in sizes_l:
            out.append(decoder.decode(data[start : start + n]))
            start += n
        return out

    def _device(self) -> torch.device:
        if self.backend_name == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else "alive"
        return (
            f"StatelessGroup(prefix={self.prefix!r}, rank={self.rank}, "
            f"world_size={self.world_size}, backend={self.backend_name}, {state})"
        )


def _device_mark() -> Callable[[], bool]:
    """Whether the device reached this point of the current stream (a CUDA event recorded
    now): before a collective is waited for, whether it can run (all it follows is done)."""
    event = torch.cuda.Event()
    event.record()
    return event.query


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _make_gloo(
    store: PrefixStore,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    host: str,
    local_addr: str | None,
) -> tuple[Any, Any, torch.device]:
    gloo: Any = dist.ProcessGroupGloo  # its ``_Options`` is missing from torch's stubs
    opts = gloo._Options()
    opts._timeout = timeout
    if local_addr is None and host in _LOOPBACK:
        local_addr = "127.0.0.1"
    if local_addr is None:
        # This host's address facing the store's host (the DP address itself on that
        # host), rather than whatever the machine's hostname resolves to.
        local_addr = local_address_towards(host)
    if local_addr is None:
        opts._devices = [gloo.create_default_device()]
    else:
        opts._devices = [gloo.create_device(hostname=local_addr)]
    backend = gloo(store, rank, world_size, opts)
    return backend, dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")


def _make_nccl(
    store: PrefixStore, rank: int, world_size: int, timeout: datetime.timedelta
) -> tuple[Any, Any, torch.device]:
    # Untested in this repository's CPU CI: written against torch's ProcessGroupNCCL API.
    if not dist.is_nccl_available() or not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' requires a CUDA build of torch with NCCL and a GPU")
    nccl = dist.ProcessGroupNCCL
    opts = nccl.Options()
    opts._timeout = timeout
    opts.is_high_priority_stream = False
    backend = nccl(store, rank, world_size, opts)
    device = torch.device("cuda", torch.cuda.current_device())
    return backend, dist.ProcessGroup.BackendType.NCCL, device
