"""``MultiprocExecutor``: one DP rank's ``tensor_parallel_size`` workers in processes of
their own (docs/architecture.md#tensor-parallel), driven through the ``Executor`` interface like the in-process one.

Wire: every call is broadcast to all workers through a shared-memory ring
(``tidal/distributed/shm_queue.py``: one copy into shared memory per step, however many
workers; payloads over a chunk overflow to ZMQ); replies come back on a PULL socket, and
only the driver (TP rank 0) answers a step (``ReplyMode.DRIVER``). A step's input crosses
in its delta form (``tidal/executor/step_wire.py``). Messages are msgspec Structs of
``tidal.protocol.worker``; arguments and results are decoded into the called method's
annotated types (``tidal.executor.rpc.rpc_signature``): no pickle anywhere. What a call
needs beyond that -- which workers answer, a time bound, whether its failure is the
rank's death -- its ``@rpc`` declares (docs/architecture.md#worker-rpc).

Startup is strict: the ring, the reply socket, the rank's TCPStore (the TP group's) and a
death pipe per worker exist first; then every worker is spawned (``python -m
tidal.executor.worker_proc``: the user's script is never re-imported; the ring's
descriptor and its death pipe's read end are inherited; on CUDA ``CUDA_VISIBLE_DEVICES``
is its device slot alone, on CPU its OpenMP threads wait as an engine process's do and
number its share of the cores, ``tidal/utils/cpu_threads.py``); the segment's name is
unlinked at once (the creator's job: nothing is left in /dev/shm whoever dies later; an
engine killed before that leaves it, and its socket directory, named with its pid: the
next start on the host removes those of owners that are gone); then
every HELLO, then every reader attached, then ``worker.start`` on all of them (TP group,
DP/EP groups, model: TP rank 0 chooses the CPU paths for all, ``tidal/kernels/select.py``).
A worker that exits or fails meanwhile fails the startup, naming it.

Worker death (docs/architecture.md#faults): a monitor thread watches the workers' sentinels. A worker
that exits while the rank serves is the death of the whole rank: the others are killed
(their peers in other ranks then fail their collectives at once), every pending and later
call raises ``WorkerDied``, and the engine is told through its failure callback -- it
exits as dead, and the frontend recovers as for any dead rank. The engine's own death is
seen by each worker through its death pipe (EOF): it exits.

Threads (the same as for an in-process worker): the busy loop calls most methods; the
elastic shell's helper threads call the blocking ones meanwhile. A call from another
thread than the one that built the executor runs on a thread of its own in each worker
(``WorkerCall.background``). Sends are serialised by a lock; whichever thread waits reads
the reply socket for everyone (one reader at a time, a condition hands results over).
Shutdown refuses new calls (``worker.waiting_on_peers``, asked for every heartbeat,
answers False: ``empty_after_shutdown``), waits for other threads' calls in flight to
leave, and only then unmaps the ring and closes the sockets they use.

Failures: a worker answers every failure whatever the reply mode. ``GroupFailure`` (a peer
rank died) is raised as such, so the DP busy loop recovers; any other error is
``WorkerError``, which the engine treats as fatal (the rank too, unless the call is
``local``). Calls that clean up after a failure are bounded in time (``timeout_s``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

import msgspec
import zmq
from torch.distributed import TCPStore

from tidal.config import EngineConfig
from tidal.distributed.device_slots import visible_devices
from tidal.distributed.groups import GroupFailure, serve_store
from tidal.distributed.ports import IPC_DIR_PREFIX
from tidal.distributed.shm_queue import (
    QueueClosed,
    ReaderGone,
    ShmQueueWriter,
    owner_gone,
    remove_orphaned_segments,
)
from tidal.executor.base import Executor
from tidal.executor.batch import SchedulerOutput
from tidal.executor.rpc import Rpc
from tidal.executor.step_wire import StepEncoder
from tidal.executor.worker import TP_STORE_HOST
from tidal.executor.worker_proc import WORKER_ENTRY_MODULE, WorkerLaunch, worker_process_name
from tidal.models.config_wire import split_hf_config
from tidal.protocol.topology import Topology
from tidal.protocol.worker import ReplyMode, WorkerCall, WorkerErrorKind, WorkerHello, WorkerReply
from tidal.utils.cpu_threads import engine_process_env, usable_cores
from tidal.utils.procs import ModuleProcess

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # workers import torch and load their shard meanwhile
FREEZE_POLL_S = 1.0
FREEZE_TIMEOUT_S = 5.0  # a worker stopped this long is dead
# A call in flight notices a shutdown within one poll of the reply socket (0.1 s); this
# bounds the wait for them on a starved machine.
_CALLS_LEAVE_S = 30.0
# An engine's private socket directory: this, its pid, "-", random (``mkdtemp``).
SOCKET_DIR_PREFIX = f"{IPC_DIR_PREFIX}tp-"
_REPLY_DECODER = msgspec.msgpack.Decoder(WorkerReply)
_HELLO_DECODER = msgspec.msgpack.Decoder(WorkerHello)


def _remove_leftovers() -> None:
    """Remove what engines killed during their TP startup left (their ring's name in
    /dev/shm, their socket directory): only where the owner named is gone, never a live
    engine's."""
    removed = remove_orphaned_segments()
    tmp = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            if owner_gone(name, SOCKET_DIR_PREFIX):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
                removed.append(name)
    if removed:
        logger.info("removed what dead engines left: %s", ", ".join(sorted(removed)))


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, traced): state T or t in /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"T", b"t")


class WorkerDied(RuntimeError):
    """A worker of this rank died, or stopped answering: the rank is dead."""


class WorkerError(RuntimeError):
    """A worker call failed (not a peer rank's death): fatal for the rank."""


@dataclass
class _Call:
    expect: frozenset[int]  # TP ranks whose results complete it
    result_type: Any
    results: dict[int, Any] = field(default_factory=dict)
    error: WorkerReply | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or self.expect <= self.results.keys()


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        *,
        topology: Topology | None = None,
        engine_id: int | None = None,
        joining: bool = False,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        """As ``UniProcExecutor``: ``topology``/``engine_id`` place this rank (None: the
        launch topology of ``config``); ``joining``: an elastic EP joiner."""
        super().__init__(config)
        p = config.parallel
        self.tp_size = p.tensor_parallel_size
        self.engine_id = p.data_parallel_rank if engine_id is None else engine_id
        self._home_thread = threading.get_ident()
        self._cond = threading.Condition()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._reading = False
        self._failure: str | None = None
        self._stopping = False
        # Calls in flight, by calling thread: shutdown releases the ring and the sockets
        # only once every other thread's call has left them (the engine's output thread
        # asks ``waiting_on_peers`` for its heartbeats whenever it likes).
        self._busy: Counter[int] = Counter()
        self._callbacks: list[Callable[[str], None]] = []
        self._send_lock = threading.Lock()
        self._procs: list[ModuleProcess] = []
        self._death_w: list[int] = []
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self.encoder = StepEncoder()
        self.queue: ShmQueueWriter | None = None
        self._tp_store: TCPStore | None = None
        _remove_leftovers()
        # The owner's pid in the name: a later start removes it if this process dies first.
        self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        self._ctx = zmq.Context()
        try:
            self._replies = self._ctx.socket(zmq.PULL)
            self._replies.setsockopt(zmq.LINGER, 0)
            self._reply_address = f"ipc://{self._dir}/replies"
            self._replies.bind(self._reply_address)
            self.queue = ShmQueueWriter(
                self.tp_size, ctx=self._ctx, overflow_address=f"ipc://{self._dir}/broadcast"
            )
            # Loopback only: torch's own server would listen on every interface.
            self._tp_store = serve_store(
                TP_STORE_HOST, world_size=self.tp_size + 1, timeout_s=startup_timeout_s
            )
            for t in range(self.tp_size):
                self._spawn(t)
            self.queue.unlink()  # every worker inherited the descriptor
            deadline = time.monotonic() + startup_timeout_s
            self._wait_for_hellos(deadline)
            self.queue.wait_for_readers(max(1.0, deadline - time.monotonic()), self._exited)
            self._monitor = threading.Thread(
                target=self._watch, name=f"tp-monitor-{self.engine_id}", daemon=True
            )
            self._monitor.start()
            self.call("worker.start", topology, engine_id, joining, None, self._tp_store.port)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "engine %d: %d TP workers ready (pids %s)", self.engine_id, self.tp_size,
            self.worker_pids(),
        )  # fmt: skip

    # ---- startup ------------------------------------------------------------------------

    def _spawn(self, t: int) -> None:
        assert self.queue is not None and self._tp_store is not None
        config = self.config
        wire, hf = split_hf_config(config)
        death_r, death_w = os.pipe()
        self._death_w.append(death_w)
        launch = WorkerLaunch(
            config=wire,
            hf_config=hf,
            engine_id=self.engine_id,
            tp_rank=t,
            queue=self.queue.handle,
            reply_address=self._reply_address,
            socket_dir=self._dir,
            queue_fd=self.queue.fd,
            death_fd=death_r,
        )
        env = {}
        if config.device == "cuda":
            slots = config.parallel.device_ids or tuple(range(self.tp_size))
            env["CUDA_VISIBLE_DEVICES"] = visible_devices([slots[t]], os.environ)
        else:  # beside the engine core and its peers: OpenMP threads that yield, its share
            local = config.parallel.data_parallel_size_local * self.tp_size
            env.update(engine_process_env(os.environ, cores=usable_cores(), local_ranks=local))
        try:
            proc = ModuleProcess(
                WORKER_ENTRY_MODULE,
                worker_process_name(self.engine_id, t),
                msgspec.msgpack.encode(launch),
                pass_fds=(self.queue.fd, death_r),
                env=env,
            )
        finally:
            os.close(death_r)  # the worker holds its copy
        self._procs.append(proc)

    def _exited(self) -> str | None:
        for t, p in enumerate(self._procs):
            code = p.exitcode
            if code is not None:
                return (
                    f"worker {t} (pid {p.pid}) of engine {self.engine_id} exited with code {code}"
                )
        return None

    def _wait_for_hellos(self, deadline: float) -> None:
        pending = set(range(self.tp_size))
        while pending:
            why = self._exited()
            if why is not None:
                raise WorkerDied(f"{why} during its startup")
            if time.monotonic() > deadline:
                raise WorkerDied(
                    f"TP workers {sorted(pending)} of engine {self.engine_id} did not start"
                )
            if self._replies.poll(100):
                hello = _HELLO_DECODER.decode(self._replies.recv())
                pending.discard(hello.tp_rank)

    # ---- calls ---------------------------------------------------------------------------

    def _run(self, rpc: Rpc, args: tuple[Any, ...]) -> list[Any]:
        """Broadcast one call; the results of the workers its reply mode names, by TP
        rank. A ``SchedulerOutput`` crosses as the step's deltas (``StepEncoder``)."""
        spec = rpc.spec
        expect = frozenset({0} if spec.reply is ReplyMode.DRIVER else range(self.tp_size))
        me = threading.get_ident()
        with self._cond:
            if self._stopping and spec.empty_after_shutdown:
                return []  # e.g. nothing waits on peers once shutdown began
            if self._failure is not None:
                raise WorkerDied(self._failure)
            if self._stopping:
                raise WorkerDied(self._shut_down())
            call_id = next(self._ids)
            self._calls[call_id] = _Call(expect, rpc.result)
            self._busy[me] += 1
        try:
            wire = [self.encoder.encode(a) if isinstance(a, SchedulerOutput) else a for a in args]
            return self._send_and_wait(call_id, rpc, wire)
        except WorkerDied:
            with self._cond:
                if spec.empty_after_shutdown and self._stopping:
                    return []  # shutdown began while it waited
            raise
        finally:
            with self._cond:
                self._busy[me] -= 1
                if not self._busy[me]:
                    del self._busy[me]
                self._cond.notify_all()

    def _send_and_wait(self, call_id: int, rpc: Rpc, args: list[Any]) -> list[Any]:
        call = WorkerCall(
            call_id,
            rpc.method,
            msgspec.Raw(msgspec.msgpack.encode(args)),
            rpc.spec.reply,
            background=threading.get_ident() != self._home_thread,
            driver_only=rpc.spec.driver_only,
        )
        frame = msgspec.msgpack.encode(call)
        assert self.queue is not None
        try:
            with self._send_lock:
                self.queue.put(frame, abort=self._abort_reason)
        except (ReaderGone, QueueClosed) as e:
            self._forget(call_id)
            self._fail(f"engine {self.engine_id}: {e}")
            raise WorkerDied(str(e)) from e
        done = self._wait(call_id, rpc)
        return [done.results[t] for t in sorted(done.results)]

    def _shut_down(self) -> str:
        return f"engine {self.engine_id}: its TP workers are shut down"

    def _abort_reason(self) -> str | None:
        """Why a send blocked on a full ring must stop waiting (None: it may wait on)."""
        if self._failure is not None:
            return self._failure
        return self._shut_down() if self._stopping else None

    def _forget(self, call_id: int) -> None:
        with self._cond:
            self._calls.pop(call_id, None)

    def _wait(self, call_id: int, rpc: Rpc) -> _Call:
        method, timeout_s = rpc.method, rpc.spec.timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._cond:
                call = self._calls[call_id]
                failure = self._failure
                if failure is None and self._stopping and not call.done:
                    failure = self._shut_down()
                late = deadline is not None and time.monotonic() > deadline
                if call.done or failure is not None or late:
                    del self._calls[call_id]
                    break
                if self._reading:
                    self._cond.wait(0.05)
                    continue
                self._reading = True
            try:
                replies = self._receive(100)
            finally:
                with self._cond:
                    self._reading = False
                    stray = [r for r in replies if not self._deliver(r)]
                    self._cond.notify_all()
            for r in stray:  # an error after its call completed: the rank is out of step
                self._fail(f"worker {r.tp_rank} of engine {self.engine_id}: {r.error}")
        if not call.done:
            if failure is None:
                failure = (
                    f"engine {self.engine_id}: TP workers did not answer {method} "
                    f"within {timeout_s:g}s"
                )
                self._fail(failure)
            raise WorkerDied(failure)
        err = call.error
        if err is not None:
            if err.error_kind is WorkerErrorKind.GROUP_FAILURE:
                raise GroupFailure(err.error or "a collective failed")
            why = f"worker {err.tp_rank} of engine {self.engine_id}: {method}: {err.error}"
            if not rpc.spec.local:
                self._fail(why)  # the rank's workers may be out of step: it is dead
            raise WorkerError(why)
        return call

    def _receive(self, timeout_ms: int) -> list[WorkerReply]:
        out: list[WorkerReply] = []
        if not self._replies.poll(timeout_ms):
            return out
        while True:
            try:
                frame = self._replies.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(_REPLY_DECODER.decode(frame))

    def _deliver(self, reply: WorkerReply) -> bool:
        """Hand ``reply`` to its call (under the lock). False: a failure of a call that is
        no longer waited for (the caller fails the rank); a late result is just dropped."""
        call = self._calls.get(reply.call_id)
        if call is None:
            return reply.error is None or reply.error_kind is WorkerErrorKind.GROUP_FAILURE
        if reply.error is not None:
            if call.error is None:
                call.error = reply
            return True
        call.results[reply.tp_rank] = msgspec.msgpack.decode(reply.result, type=call.result_type)
        return True

    # ---- the Executor interface --------------------------------------------------------

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        with self._cond:
            self._callbacks.append(callback)
            failed = self._failure
        if failed is not None:
            callback(failed)

    # ---- worker death --------------------------------------------------------------------

    def _watch(self) -> None:
        """Until shutdown: a worker's exit, or a worker stopped (SIGSTOP, a debugger) for
        ``FREEZE_TIMEOUT_S``, is the rank's death: a frozen worker is handled like a
        dead one (docs/architecture.md#faults), not waited for."""
        sentinels = {p.sentinel: t for t, p in enumerate(self._procs)}
        stopped_since: dict[int, float] = {}
        while True:
            ready = wait_sentinels([self._wake_r, *sentinels], timeout=FREEZE_POLL_S)
            if self._stopping:
                return
            why = self._exited() if ready else None
            now = time.monotonic()
            for t, p in enumerate(self._procs):
                if not _stopped(p.pid):
                    stopped_since.pop(t, None)
                elif now - stopped_since.setdefault(t, now) >= FREEZE_TIMEOUT_S:
                    why = why or (
                        f"worker {t} (pid {p.pid}) of engine {self.engine_id} has been "
                        f"stopped for {FREEZE_TIMEOUT_S:g}s"
                    )
            if why is not None:
                self._fail(why)
                return

    def _fail(self, why: str) -> None:
        """The rank is dead: record why, kill what is left of it, tell the engine."""
        with self._cond:
            if self._failure is not None or self._stopping:
                return
            self._failure = why
            self._cond.notify_all()
            callbacks = list(self._callbacks)
        logger.error("engine %d: %s; the rank is dead", self.engine_id, why)
        for p in self._procs:
            with contextlib.suppress(Exception):
                p.kill()
        for cb in callbacks:
            try:
                cb(why)
            except Exception:  # noqa: BLE001 - a callback must not stop the others
                logger.exception("worker failure callback failed")

    # ---- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (their groups first, while they can still answer), then
        release the ring, the sockets, the store and the socket directory. Idempotent;
        also after a failure, and from a half-finished startup."""
        with self._cond:
            if self._stopping:
                return
            orderly = self._failure is None and self._monitor is not None
        if orderly:
            try:
                self.call("worker.shutdown")
            except Exception as e:  # noqa: BLE001 - stopping anyway
                logger.warning("engine %d: TP workers' shutdown failed: %s", self.engine_id, e)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            # Calls of other threads see ``_stopping`` within a poll and leave; only then
            # may the ring be unmapped and the sockets closed under them.
            me = threading.get_ident()
            if not self._cond.wait_for(lambda: self._busy.keys() <= {me}, _CALLS_LEAVE_S):
                logger.warning(
                    "engine %d: calls of threads %s still in flight at shutdown",
                    self.engine_id, sorted(self._busy.keys() - {me}),
                )  # fmt: skip
        if not orderly:  # a worker watching its death pipe leaves at once
            self._close_death_pipes()
        if self.queue is not None:
            self.queue.close()  # the workers leave their loop
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        with contextlib.suppress(OSError, ValueError):
            self._wake_w.send_bytes(b"w")
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(5)
        self._close_death_pipes()
        for p in self._procs:
            p.close()
        with contextlib.suppress(Exception):
            self._replies.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()
        self._ctx.term()
        self._tp_store = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def _close_death_pipes(self) -> None:
        for fd in self._death_w:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._death_w = []
