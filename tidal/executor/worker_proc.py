"""A tensor-parallel worker process: ``python -m tidal.executor.worker_proc Worker_DP<e>_TP<t>``.

Started by its engine's ``MultiprocExecutor`` as a fresh interpreter (never
multiprocessing's spawn, which would re-import the user's ``__main__``), it reads one
``WorkerLaunch`` on stdin, then:

1. attaches to the engine's broadcast queue (the segment's descriptor is inherited) and
   connects its reply socket; builds its ``Worker`` (device, threads); says HELLO;
2. serves ``WorkerCall``s in queue order until the queue closes: each names an exported
   method of the worker's parts (``WORKER_RPCS``, docs/architecture.md#worker-rpc; any
   other name is refused, naming it); its arguments are decoded into that method's
   annotated types (a ``SchedulerOutput`` from the step's deltas, ``StepDecoder``) and
   its result encoded back (``WorkerReply``) when the call's reply mode asks this worker
   for it. A call the
   engine made from a helper thread (``background``: elastic rendezvous, transfers) runs
   on a thread of its own here too, so the worker keeps stepping meanwhile -- exactly
   the concurrency of an in-process worker. Failures always answer: a ``GroupFailure``
   (a peer rank died) as such, anything else as an error;
3. exits when the queue closes (the engine's shutdown), or at once when the engine dies:
   its death pipe hits EOF. Then it also removes the engine's private socket directory,
   which the dead engine can no longer remove (as engines do for a dead frontend).

SIGINT is ignored: a worker can share the terminal's process group with an in-process
engine (``LLM``), and Ctrl-C is the engine's to handle; the engine stops its workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from tidal.config import EngineConfig
from tidal.distributed.groups import GroupFailure, LocalGroupFailure
from tidal.distributed.ports import IPC_DIR_PREFIX
from tidal.distributed.shm_queue import QueueCancelled, QueueClosed, ShmQueueReader
from tidal.executor.batch import SchedulerOutput
from tidal.executor.step_wire import StepDecoder
from tidal.executor.worker import WORKER_RPCS, Worker
from tidal.models.config_wire import join_hf_config
from tidal.protocol.worker import (
    ReplyMode,
    ShmQueueHandle,
    StepInput,
    WorkerCall,
    WorkerErrorKind,
    WorkerHello,
    WorkerReply,
)
from tidal.utils.procs import read_child_launch

logger = logging.getLogger(__name__)

WORKER_ENTRY_MODULE = "tidal.executor.worker_proc"
_CALL_DECODER = msgspec.msgpack.Decoder(WorkerCall)
_ARGS_DECODER = msgspec.msgpack.Decoder(list[msgspec.Raw])
_STEP_DECODER = msgspec.msgpack.Decoder(StepInput)
# The calls that run the model: TP collectives interleaved with the DP/EP ones.
_STEP_CALLS = frozenset({"runner.execute_model", "runner.execute_dummy_batch"})


class WorkerLaunch(msgspec.Struct, frozen=True):
    """What a worker reads on its stdin (msgspec msgpack; like ``EngineLaunch``)."""

    config: EngineConfig  # with model.hf_config = None; see hf_config
    hf_config: dict[str, Any] | None
    engine_id: int
    tp_rank: int
    queue: ShmQueueHandle
    reply_address: str
    socket_dir: str  # the engine's private ipc:// directory
    queue_fd: int = -1  # the ring's descriptor, inherited (-1: attach by name)
    death_fd: int = -1  # read end of the engine's death pipe: EOF = the engine is gone


def worker_process_name(engine_id: int, tp_rank: int) -> str:
    return f"Worker_DP{engine_id}_TP{tp_rank}"


class WorkerProc:
    """One worker process: the call loop around a ``Worker``."""

    def __init__(self, launch: WorkerLaunch) -> None:
        self.config = join_hf_config(launch.config, launch.hf_config)
        self.engine_id = launch.engine_id
        self.tp_rank = launch.tp_rank
        self.socket_dir = launch.socket_dir
        self.ctx = zmq.Context()
        self.reply = self.ctx.socket(zmq.PUSH)
        self.reply.setsockopt(zmq.LINGER, 1000)
        self.reply.connect(launch.reply_address)
        self._reply_lock = threading.Lock()  # background calls reply from their threads
        self.queue = ShmQueueReader(launch.queue, launch.tp_rank, fd=launch.queue_fd, ctx=self.ctx)
        if launch.queue_fd >= 0:
            os.close(launch.queue_fd)  # mapped: the descriptor is not needed any more
        if launch.death_fd >= 0:
            threading.Thread(
                target=self._watch_engine, args=(launch.death_fd,), name="death-pipe", daemon=True
            ).start()
        self.worker = Worker(
            self.config,
            local_rank=self.config.parallel.data_parallel_rank,
            tp_rank=launch.tp_rank,
            device_index=0,  # CUDA_VISIBLE_DEVICES holds this worker's slot only
        )
        self.targets = self.worker.rpc_targets()
        self.steps = StepDecoder()
        self._background: list[threading.Thread] = []
        self._send(msgspec.msgpack.encode(WorkerHello(self.tp_rank, os.getpid())))

    # ---- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """Serve the engine's calls in queue order on this (the home) thread. A reader
        thread takes them off the queue, so a background call (``worker.abort_collectives`` from
        the engine's input thread) still runs while this thread is blocked in a step's
        collective: a frozen peer rank must not hold it there until the timeout."""
        self.worker.home_thread = threading.get_ident()
        calls: queue.SimpleQueue[WorkerCall | None] = queue.SimpleQueue()
        reader = threading.Thread(
            target=self._read, args=(calls,), name="queue-reader", daemon=True
        )
        reader.start()
        while (call := calls.get()) is not None:
            self._serve(call)
        reader.join(5)

    def _read(self, calls: queue.SimpleQueue[WorkerCall | None]) -> None:
        try:
            while True:
                try:
                    raw = self.queue.get()
                except (QueueClosed, QueueCancelled):
                    return
                call = _CALL_DECODER.decode(raw)
                if call.driver_only and self.tp_rank != 0:
                    continue
                if not call.background:
                    calls.put(call)
                    continue
                t = threading.Thread(
                    target=self._serve, args=(call,), name=f"call-{call.method}", daemon=True
                )
                self._background = [b for b in self._background if b.is_alive()] + [t]
                t.start()
        finally:
            calls.put(None)  # whatever ended the reader ends the worker

    def _serve(self, call: WorkerCall) -> None:
        answer = call.reply is ReplyMode.ALL or self.tp_rank == 0
        try:
            rpc, fn = WORKER_RPCS.bind(self.targets, call.method)
            result = self.worker.serve(rpc, fn, self._decode_args(rpc.params, call))
            if answer:
                self._reply(WorkerReply(call.call_id, self.tp_rank, msgspec.Raw(_encode(result))))
            return
        except Exception as e:  # noqa: BLE001 - the engine decides; this worker goes on
            error = e
        kind = WorkerErrorKind.ERROR
        if isinstance(error, GroupFailure) or (
            isinstance(error, LocalGroupFailure) and call.method in _STEP_CALLS
        ):
            kind = WorkerErrorKind.GROUP_FAILURE
            if call.method in _STEP_CALLS:
                # A peer rank died mid-step. This worker's TP peers may be waiting in a TP
                # collective it will never enter: break the group so they fail now too
                # (and answer the same). A dead TP peer is the rank's death, which the
                # engine's monitor sees.
                self.worker.break_tensor_parallel()
        else:
            logger.error(
                "worker %d of engine %d: %s failed:\n%s",
                self.tp_rank, self.engine_id, call.method,
                "".join(traceback.format_exception(error)),
            )  # fmt: skip
        self._reply(
            WorkerReply(
                call.call_id, self.tp_rank, error=f"{type(error).__name__}: {error}",
                error_kind=kind,
            )
        )  # fmt: skip

    def _decode_args(self, params: tuple[Any, ...], call: WorkerCall) -> list[Any]:
        raws = _ARGS_DECODER.decode(call.args)
        if len(raws) > len(params):
            raise TypeError(f"{call.method} takes {len(params)} arguments, got {len(raws)}")
        return [
            self.steps.decode(_STEP_DECODER.decode(r))
            if t is SchedulerOutput
            else msgspec.msgpack.decode(r, type=t)
            for r, t in zip(raws, params)
        ]

    def _reply(self, reply: WorkerReply) -> None:
        self._send(msgspec.msgpack.encode(reply))

    def _send(self, frame: bytes) -> None:
        with self._reply_lock:
            self.reply.send(frame)

    # ---- the engine's death -------------------------------------------------------------

    def _watch_engine(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 64):
                pass
        # EOF: the engine is gone without stopping us (killed). Nobody else removes its
        # socket directory now (only one it made: our prefix, never a caller's path).
        if os.path.basename(self.socket_dir).startswith(IPC_DIR_PREFIX):
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        logger.warning(
            "worker %d of engine %d: the engine is gone, exiting", self.tp_rank, self.engine_id
        )
        os._exit(1)

    def close(self) -> None:
        for t in self._background:
            t.join(2)
        self.worker.shutdown()
        self.queue.close()
        self.reply.close(linger=1000)
        self.ctx.term()


def _encode(result: Any) -> bytes:
    return msgspec.msgpack.encode(result)


def run_worker(launch: WorkerLaunch, on_ready: Callable[[WorkerProc], None] | None = None) -> int:
    """Run one worker until the engine closes the queue; the exit code."""
    proc: WorkerProc | None = None
    try:
        proc = WorkerProc(launch)
        if on_ready is not None:
            on_ready(proc)
        proc.run()
        return 0
    except Exception:  # noqa: BLE001 - logged; the engine sees the exit
        logger.error("worker %d of engine %d died:\n%s", launch.tp_rank, launch.engine_id,
                     traceback.format_exc())  # fmt: skip
        return 1
    finally:
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.close()


def main() -> None:
    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "WARNING"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, payload = read_child_launch()
    launch = msgspec.msgpack.decode(payload, type=WorkerLaunch)
    os._exit(run_worker(launch))  # skip interpreter teardown of torch / zmq threads


if __name__ == "__main__":
    main()
