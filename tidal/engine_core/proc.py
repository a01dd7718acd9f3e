"""EngineCoreProc: an EngineCore in its own process, with ZMQ I/O threads around it.
(Its data-parallel subclass, with the wave loop, is ``dp_proc.DPEngineCoreProc``.)

Threads:
- input thread: DEALER (identity = engine id, 2 bytes little-endian) -> ``input_queue``
- busy loop (main thread): owns the scheduler alone; drains the queue, steps the engine
- output thread: ``output_queue`` -> PUSH

Startup: the handshake with the frontend (``handshake.py``: HELLO -> addresses, config
hash and topology -> READY; an engine with another config or outside the topology fails
fast), then the I/O threads connect, then the engine core is built (the DP subclass joins
its process groups at its position in the topology) and READY is sent. Over TCP
(multi-node) every socket here is a CURVE client keyed by the deployment's shared secret
(``tidal/distributed/zmq_auth.py``).

Shutdown: RUNNING -(SIGTERM/SIGINT)-> REQUESTED -> SHUTTING_DOWN (stop admitting, drain
for up to ``drain_timeout_s``, then abort what is left) -> exit. A fatal error sends an
``EngineCoreOutputs(engine_dead=True)`` before exiting so clients fail fast.

No silent thread death: a frame the input thread cannot decode, or a message the output
thread cannot encode, is dropped, counted (``utility_io_stats``) and logged, and the
thread goes on; a utility result that cannot be encoded becomes that call's failure (it
is encoded on the busy loop, before it is queued); request outputs that cannot be
encoded fail their requests. Anything else that ends an I/O thread (a socket error, a
bug) is fatal for the engine: the thread records it (the output thread also tries to send
ENGINE_CORE_DEAD itself), the busy loop raises at its next turn, and the process exits
non-zero after ENGINE_CORE_DEAD, instead of living on deaf or mute.

Liveness (docs/architecture.md#faults): the output thread's heartbeats carry the busy loop's progress
(``EngineProgress``: iterations begun, inside one or idle, waiting on peers there), which
the frontend's stall watchdog reads. The engine watches its *launcher* -- the process that
asked for it (``launcher_pid``), not its parent, which is a warm launcher for a forked
engine -- and leaves when it is gone; only then does it remove the launcher's private
``ipc://`` directory, which a live launcher still owns.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from typing import Any

import zmq

from tidal.config import EngineConfig
from tidal.distributed.ports import IPC_DIR_PREFIX
from tidal.distributed.zmq_auth import curve_keys, secure_client
from tidal.engine_core.core import EngineCore
from tidal.engine_core.handshake import EngineHandshake
from tidal.engine_core.request_decode import UndecodableRequest, decode_client_request
from tidal.executor.base import Executor
from tidal.executor.select import create_executor
from tidal.protocol.errors import EngineStartupError
from tidal.protocol.messages import (
    HEARTBEAT_INTERVAL_S,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineProgress,
    FinishReason,
    StartDPWave,
    UtilityOutput,
    UtilityRequest,
    decode_engine_message,
    encode,
    engine_identity,
)
from tidal.protocol.topology import Topology
from tidal.utils.dropped import DropCounter
from tidal.utils.procs import ProcessWatch
from tidal.utils.proctitle import set_process_name

logger = logging.getLogger(__name__)

TO_CLIENT, TO_COORDINATOR = 0, 1
# How long the idle busy loop blocks on its queue before re-checking shutdown flags.
_IDLE_POLL_S = 0.05
# How long a loop whose requests can none of them run (each waits for its grammar to
# compile) blocks on its queue before stepping again. Spinning instead would hold the GIL
# against the compile thread: each of its imports' file reads waits out a switch interval.
_STALLED_POLL_S = 0.002


class FrontendWatch:
    """Whether the frontend fell silent. Only a frontend that sends heartbeats is
    watched (the offline ``LLM`` does not): from its first HEARTBEAT on, any message
    proves it alive, and ``timeout_s`` (``--frontend-timeout``) without one is its death."""

    def __init__(self, timeout_s: float, enabled: bool = True) -> None:
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.last: float | None = None  # None until the first heartbeat

    def heard(self, heartbeat: bool, now: float) -> None:
        if heartbeat or self.last is not None:
            self.last = now

    def silent(self, now: float) -> bool:
        return self.enabled and self.last is not None and now - self.last > self.timeout_s


class LoopProgress:
    """The busy loop's progress, written by it and read by the output thread for the
    heartbeats (plain attribute reads and writes: atomic under the GIL). ``idle`` only
    while the loop waits for input with nothing to do; ``iterations`` counts the
    iterations begun."""

    def __init__(self) -> None:
        self.iterations = 0
        self.idle = True  # before the loop runs (startup) it is not inside an iteration

    def begin_iteration(self) -> None:
        self.iterations += 1
        self.idle = False


class EngineIOThreadError(RuntimeError):
    """An I/O thread of the engine failed: the engine cannot hear or answer any more."""


class ExecutorFailed(RuntimeError):
    """A worker of this rank died (tensor parallelism): the rank is dead."""


@enum.unique
class ShutdownState(enum.Enum):
    RUNNING = enum.auto()
    REQUESTED = enum.auto()
    SHUTTING_DOWN = enum.auto()


class EngineCoreProc:
    """One engine core process. ``run_engine_core`` is the process entry point."""

    def __init__(
        self,
        config: EngineConfig,
        engine_id: int,
        handshake_address: str,
        drain_timeout_s: float = 30.0,
        launcher_pid: int | None = None,
    ) -> None:
        """``launcher_pid``: the process that asked for this engine (the frontend, or a
        headless host's launcher), watched for its death; None: the parent."""
        self.config = config
        self.engine_id = engine_id
        self.drain_timeout_s = drain_timeout_s
        self._launcher = ProcessWatch(launcher_pid)
        self.progress = LoopProgress()
        self._stalled = False  # the last step ran nothing and said nothing
        self.shutdown_state = ShutdownState.RUNNING
        self._drain_deadline = 0.0
        self._abort_silently = False  # leaving without a frontend to report to (_leave_now)
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        # (destination, outputs or their msgpack): TO_CLIENT or TO_COORDINATOR; None stops
        # the thread.
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs | bytes] | None] = queue.Queue()
        self.dropped = DropCounter(f"engine {engine_id}", logger)
        # Set by an I/O thread that failed for good; the busy loop then raises.
        self._io_failure: str | None = None
        self.ctx = zmq.Context()
        self._stop_io = threading.Event()
        self.coordinator_ready = threading.Event()
        self.coordinator_wave = 0
        self._handshake_address = handshake_address
        tcp = handshake_address.startswith("tcp://")
        self._curve = curve_keys(config.parallel.data_parallel_auth_key) if tcp else None
        self._handshake = EngineHandshake(self.ctx, engine_id, handshake_address, self._curve)
        try:
            self.addresses = self._handshake.hello(config)
        except BaseException:
            self._handshake.close()  # lingers long enough to deliver a READY(error)
            self.ctx.term()
            raise
        self._start_io_threads()
        try:
            # On the busy loop's thread: its workers take this thread for the one that
            # runs their steps (``worker.waiting_on_peers``).
            self.engine_core = self._build_engine_core()
        except Exception as e:
            self._send_ready(0, error=f"{type(e).__name__}: {e}")
            raise
        # A TP worker that dies is this rank's death (docs/architecture.md#faults): the busy loop
        # raises at its next turn, even when idle.
        self.engine_core.executor.register_failure_callback(self._on_executor_failure)
        self._send_ready(self.engine_core.num_blocks, self.engine_core.executor.worker_pids())

    # ---- startup -----------------------------------------------------------------------

    @property
    def topology(self) -> Topology | None:
        """The deployment this engine joined (None from a frontend that sends none). Its
        rank is its position there, not its id."""
        return self.addresses.topology

    @property
    def dp_rank(self) -> int:
        top = self.topology
        return 0 if top is None else top.rank_of(self.engine_id)

    def _build_engine_core(self) -> EngineCore:
        return EngineCore(self.config, self._make_executor())

    def _make_executor(self) -> Executor:
        # A single engine joins no process group (the DP subclass does).
        return create_executor(self.config)

    def _send_ready(
        self, num_blocks: int, worker_pids: list[int] | None = None, *, error: str | None = None
    ) -> None:
        self._handshake.send_ready(self.config.config_hash(), num_blocks, error, worker_pids)

    def _on_executor_failure(self, reason: str) -> None:
        """From the executor's monitor thread: wake the busy loop, which raises."""
        self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, reason))

    def _start_io_threads(self) -> None:
        registered = threading.Event()
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(registered,), name="engine-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, name="engine-output", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()
        registered.wait(10)

    # ---- I/O threads -------------------------------------------------------------------

    def _input_loop(self, registered: threading.Event) -> None:
        sock = coord = None
        try:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, engine_identity(self.engine_id))
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self._curve, self.addresses.input_address)
            sock.connect(self.addresses.input_address)
            sock.send(b"")  # registers our identity with the frontend's ROUTER
            coord = self._coordinator_sub()
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            if coord is not None:
                poller.register(coord, zmq.POLLIN)
            registered.set()
            # Only a frontend reached over TCP can die without our launcher dying with it
            # (headless ranks); a local one is our launcher, watched below.
            frontend = FrontendWatch(
                self.config.parallel.frontend_timeout,
                enabled=self._handshake_address.startswith("tcp://"),
            )
            while not self._stop_io.is_set():
                if self._launcher.gone():
                    # The launcher died without stopping us (SIGKILL): don't linger as an orphan.
                    self._on_launcher_death()
                if frontend.silent(time.monotonic()):
                    # A remote frontend died: release the device and ports.
                    logger.error(
                        "engine %d: no heartbeat from the frontend for %.1fs, exiting",
                        self.engine_id,
                        frontend.timeout_s,
                    )
                    frontend.enabled = False  # once
                    self._leave_now()
                for ready, _ in poller.poll(100):
                    if ready is sock:
                        frontend.heard(self._read_client_request(sock), time.monotonic())
                    elif coord is not None:
                        self._read_coordinator_message(coord)
        except BaseException as e:  # noqa: BLE001 - fatal for the engine, never silent
            if not self._stop_io.is_set():
                self._io_thread_failed("input", e)
        finally:
            registered.set()
            if sock is not None:
                sock.close()
            if coord is not None:
                coord.close()

    def _coordinator_sub(self) -> zmq.Socket | None:
        if not self.addresses.coordinator_input:
            return None
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        secure_client(sub, self._curve, self.addresses.coordinator_input)
        sub.connect(self.addresses.coordinator_input)
        return sub

    def _read_client_request(self, sock: zmq.Socket) -> bool:
        """One message from the frontend: ``[type byte, msgpack payload]``. One that does
        not decode (an unknown type, a payload missing or malformed) is dropped alone; an
        ADD whose payload is malformed is still answered (``UndecodableRequest``).
        Returns whether it was a HEARTBEAT (it goes no further)."""
        frames = sock.recv_multipart(copy=False)
        if bytes(frames[0].buffer) == EngineCoreRequestType.HEARTBEAT.value:
            return True
        try:
            payload = frames[1].buffer if len(frames) > 1 else None
            item = decode_client_request(bytes(frames[0].buffer), payload)
        except Exception as e:  # noqa: BLE001 - a bad message must not kill this thread
            self.dropped.drop("client request", e)
            return False
        self._on_input(*item)
        self.input_queue.put_nowait(item)
        return False

    def _on_input(self, req_type: EngineCoreRequestType, payload: Any) -> None:
        """The input thread, before the busy loop gets the item: what cannot wait for a
        busy loop that may be blocked (see DPEngineCoreProc)."""

    def _read_coordinator_message(self, sub: zmq.Socket) -> None:
        frames = sub.recv_multipart()
        try:
            msg = decode_engine_message(frames)
        except Exception as e:  # noqa: BLE001 - a bad message must not kill this thread
            self.dropped.drop("coordinator message", e)
            return
        if isinstance(msg, StartDPWave):
            self.input_queue.put_nowait((EngineCoreRequestType.START_DP_WAVE, msg))
        elif not self.coordinator_ready.is_set():
            # The first READY proves our subscription is live (no lost START_DP_WAVE).
            self.coordinator_wave = msg.wave
            self.coordinator_ready.set()

    def _output_loop(self) -> None:
        socks: dict[int, zmq.Socket] = {}
        try:
            socks[TO_CLIENT] = self._push_socket(self.addresses.output_address)
            if self.addresses.coordinator_output:
                socks[TO_COORDINATOR] = self._push_socket(self.addresses.coordinator_output)
            while True:
                try:
                    item = self.output_queue.get(timeout=HEARTBEAT_INTERVAL_S)
                except queue.Empty:  # nothing sent for an interval: say we are alive
                    socks[TO_CLIENT].send(self._heartbeat())
                    continue
                if item is None:
                    break
                dest, outputs = item
                frame = outputs if isinstance(outputs, bytes) else self._encode_outputs(outputs)
                if frame is not None:
                    socks[dest].send(frame)
        except BaseException as e:  # noqa: BLE001 - fatal for the engine, never silent
            if not self._stop_io.is_set():  # else: close() ended a send stuck at shutdown
                self._io_thread_failed("output", e)
                self._send_dead_directly(socks)
        finally:
            for sock in socks.values():
                sock.close()

    def _heartbeat(self) -> bytes:
        """Alive, and where the busy loop is (the frontend's stall watchdog)."""
        core = getattr(self, "engine_core", None)  # None while the engine starts
        waiting = core is not None and core.executor.call("worker.waiting_on_peers")
        p = self.progress
        progress = EngineProgress(p.iterations, not p.idle, waiting)
        return encode(
            EngineCoreOutputs(engine_id=self.engine_id, heartbeat=True, progress=progress)
        )

    def _encode_outputs(self, outputs: EngineCoreOutputs) -> bytes | None:
        """msgpack of ``outputs``; what msgspec cannot encode is replaced by what tells its
        receiver: a utility result by the call's failure, request outputs by an ERROR
        finish of their requests (which are aborted here too). Anything else is dropped
        (None)."""
        try:
            return encode(outputs)
        except Exception as e:  # noqa: BLE001 - one message is lost, not the thread
            error = e
        why = f"{type(error).__name__}: {error}"
        replacement: EngineCoreOutputs | None = None
        util = outputs.utility_output
        if util is not None:
            failure = UtilityOutput(
                util.call_id, failure_message=f"the engine could not send the result: {why}"
            )
            replacement = EngineCoreOutputs(utility_output=failure)
        elif outputs.outputs:
            ids = list(dict.fromkeys(o.request_id for o in outputs.outputs))
            reason = f"the engine could not send the request's output: {why}"
            replacement = EngineCoreOutputs(
                outputs=[
                    EngineCoreOutput(r, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
                    for r in ids
                ],
                finished_requests=set(ids),
            )
            # The scheduler still runs them: stop it (unknown or finished ids are ignored).
            self.input_queue.put_nowait((EngineCoreRequestType.ABORT, ids))
        self.dropped.drop("output message", error, exc_info=True)
        if replacement is None:
            return None
        replacement.engine_id = outputs.engine_id
        replacement.timestamp = outputs.timestamp
        try:
            return encode(replacement)
        except Exception as e:  # noqa: BLE001 - e.g. an id that is not valid unicode
            self.dropped.drop("output message", e)
            return None

    def _io_thread_failed(self, name: str, error: BaseException) -> None:
        reason = (
            f"engine {self.engine_id}: its {name} thread failed: {type(error).__name__}: {error}"
        )
        logger.error("%s\n%s", reason, "".join(traceback.format_exception(error)))
        if self._io_failure is None:
            self._io_failure = reason

    def _send_dead_directly(self, socks: dict[int, zmq.Socket]) -> None:
        """From a failed output thread: ENGINE_CORE_DEAD on its own sockets, without
        blocking (the queue has no reader any more)."""
        dead = EngineCoreOutputs(
            engine_id=self.engine_id,
            timestamp=time.monotonic(),
            engine_dead=True,
            dead_reason=self._io_failure,
        )
        for sock in socks.values():
            try:
                sock.send(encode(dead), zmq.NOBLOCK)
            except Exception:  # noqa: BLE001, S110 - best effort: the exit tells them too
                pass

    def _check_io_threads(self) -> None:
        """Raise (a fatal engine error) once an I/O thread has failed or is gone."""
        failure = self._io_failure
        if failure is None:
            if not self._output_thread.is_alive():
                failure = f"engine {self.engine_id}: its output thread is gone"
            elif not self._input_thread.is_alive() and not self._stop_io.is_set():
                failure = f"engine {self.engine_id}: its input thread is gone"
            else:
                return
        raise EngineIOThreadError(failure)

    def utility_io_stats(self) -> dict[str, Any]:
        """What the I/O threads dropped so far, by kind (``client request``,
        ``coordinator message``, ``output message``)."""
        return {"dropped": self.dropped.counts()}

    def _push_socket(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        secure_client(sock, self._curve, address)
        sock.connect(address)
        return sock

    # ---- busy loop ---------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """1. drain input (block only when idle); 2. step; 3. handle shutdown."""
        while True:
            self._process_input_queue()
            self._process_engine_step()
            if self._shutdown_done():
                return

    def _process_input_queue(self) -> None:
        self.progress.begin_iteration()
        self._check_io_threads()
        wait_s = None
        if self.shutdown_state is ShutdownState.RUNNING:
            if not self._has_work():
                wait_s = _IDLE_POLL_S
            elif self._stalled and self._may_block_when_stalled():
                wait_s = _STALLED_POLL_S
        if wait_s is not None:
            self.progress.idle = True
            try:
                item = self.input_queue.get(timeout=wait_s)
            except queue.Empty:
                return
            finally:
                self.progress.idle = False
            self._handle_client_request(*item)
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_client_request(*item)

    def _has_work(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def _may_block_when_stalled(self) -> bool:
        """Whether a stalled loop (its last step ran nothing and said nothing) may wait on
        its queue for a moment."""
        return True

    def _process_engine_step(self) -> bool:
        outputs, executed = self.engine_core.step()
        self._stalled = not executed and not outputs
        for client_outputs in outputs.values():
            self._send_outputs(client_outputs)
        return executed

    def _send_outputs(self, outputs: EngineCoreOutputs, dest: int = TO_CLIENT) -> None:
        """Queue ``outputs`` for the output thread, which encodes them."""
        self.output_queue.put_nowait((dest, self._stamp(outputs)))

    def _stamp(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        outputs.engine_id = self.engine_id
        outputs.timestamp = time.monotonic()
        return outputs

    def _handle_client_request(self, req_type: EngineCoreRequestType, payload: Any) -> None:
        if req_type is EngineCoreRequestType.ADD:
            self._add_request(payload)
        elif req_type is EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif req_type is EngineCoreRequestType.UTILITY:
            self._call_utility(payload)
        elif req_type is EngineCoreRequestType.START_DP_WAVE:
            self._start_wave(payload)
        elif req_type is EngineCoreRequestType.SCALE:
            self._on_scale(payload)
        elif req_type is EngineCoreRequestType.EXECUTOR_FAILED:
            raise ExecutorFailed(f"engine {self.engine_id}: {payload}")

    def _add_request(self, req: EngineCoreRequest | UndecodableRequest) -> None:
        if isinstance(req, UndecodableRequest):
            logger.error("engine %d: %s", self.engine_id, req.reason)
            if req.request_id is not None:
                self._reject(req.request_id, req.reason, invalid=True)
            return
        if self.shutdown_state is not ShutdownState.RUNNING:
            self._reject(req.request_id, "engine is shutting down", FinishReason.ABORT)
            return
        try:
            self.engine_core.add_request(req)
        except Exception as e:  # noqa: BLE001 - any failure to admit fails this request alone
            invalid = isinstance(e, ValueError)  # validation; anything else is our bug
            msg = str(e) if invalid else f"{type(e).__name__}: {e}"
            self._reject(req.request_id, msg, invalid=invalid)

    def _reject(
        self,
        request_id: str,
        reason: str,
        finish_reason: FinishReason = FinishReason.ERROR,
        *,
        invalid: bool = False,
    ) -> None:
        out = EngineCoreOutput(
            request_id,
            [],
            finish_reason=finish_reason,
            stop_reason=reason,
            invalid_request=invalid,
        )
        self._send_outputs(EngineCoreOutputs(outputs=[out], finished_requests={request_id}))

    def _call_utility(self, call: UtilityRequest) -> None:
        result = UtilityOutput(call.call_id)
        try:
            method = getattr(self, "utility_" + call.method_name, None) or getattr(
                self.engine_core, call.method_name
            )
            if call.method_name.startswith("_"):
                raise AttributeError(call.method_name)
            result.result = method(*call.args)
        except Exception as e:  # noqa: BLE001 - reported to the caller, engine keeps going
            result.failure_message = f"{call.method_name} failed: {type(e).__name__}: {e}"
        # Encoded here, not on the output thread: a result msgspec cannot encode becomes
        # this call's failure.
        outputs = self._stamp(EngineCoreOutputs(utility_output=result))
        try:
            frame: bytes | None = encode(outputs)
        except Exception as e:  # noqa: BLE001 - reported to the caller, engine keeps going
            result.result = None
            result.failure_message = (
                f"{call.method_name} failed: its result cannot be sent: {type(e).__name__}: {e}"
            )
            frame = self._encode_outputs(outputs)
        if frame is not None:
            self.output_queue.put_nowait((TO_CLIENT, frame))

    def _start_wave(self, msg: StartDPWave) -> None:
        """Data parallel only (see DPEngineCoreProc)."""

    def _on_scale(self, msg: Any) -> None:
        """Elastic EP only (see DPEngineCoreProc)."""
        logger.warning(
            "engine %d: ignored %s: elastic EP is not enabled",
            self.engine_id,
            type(msg).__name__,
        )

    # ---- shutdown ----------------------------------------------------------------------

    def request_shutdown(self, *_: Any) -> None:
        if self.shutdown_state is ShutdownState.RUNNING:
            self.shutdown_state = ShutdownState.REQUESTED

    def _on_launcher_death(self) -> None:
        self._remove_orphaned_ipc_dir()
        self._leave_now()

    def _leave_now(self) -> None:
        """Nobody is left to serve: exit without draining."""
        if not hasattr(self, "engine_core"):
            # Still starting: the main thread may wait minutes in the group rendezvous for
            # ranks that will never come, and there is nothing to drain. Leave now.
            logger.error("engine %d: launcher gone during startup, exiting", self.engine_id)
            os._exit(1)
        # Nobody is left to read what a drain would produce: leave without one. The
        # timeout is zeroed before the request so the busy loop never sets a later deadline.
        # Nor are the requests reported aborted: a frontend that still lives (the launcher
        # that died was a Ray actor or a headless host's launcher) takes this exit for a
        # rank death and resumes them elsewhere (docs/architecture.md#faults), where an ABORT would have
        # ended its clients' streams.
        self._abort_silently = True
        self.drain_timeout_s = 0.0
        self._drain_deadline = 0.0
        self.request_shutdown()

    def _remove_orphaned_ipc_dir(self) -> None:
        """The launcher owns its private ``ipc://`` directory and removes it at shutdown;
        a SIGKILL skips that, so the engines it leaves behind remove it (any of them, in any
        order: rmtree ignores what another already removed). Only a directory made by the
        frontend's ``mkdtemp(prefix="tidal-")`` is touched, never a caller-chosen path, and
        only once the launcher that owns it has exited (``_launcher``: the frontend itself,
        never a warm launcher that forked this engine for it)."""
        if not self._handshake_address.startswith("ipc://"):
            return
        directory = os.path.dirname(self._handshake_address[len("ipc://") :])
        if os.path.basename(directory).startswith(IPC_DIR_PREFIX):
            shutil.rmtree(directory, ignore_errors=True)

    def _shutdown_done(self) -> bool:
        if self.shutdown_state is ShutdownState.RUNNING:
            return False
        if self.shutdown_state is ShutdownState.REQUESTED:
            self.shutdown_state = ShutdownState.SHUTTING_DOWN
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
        if self._has_work() and time.monotonic() < self._drain_deadline:
            return False
        self._abort_all(
            "engine shut down before the request finished", report=not self._abort_silently
        )
        return True

    def _abort_all(self, reason: str, *, report: bool = True) -> None:
        """Abort every unfinished request; with ``report``, tell their clients (ABORT)."""
        ids = self.engine_core.scheduler.unfinished_request_ids()
        if not ids:
            return
        self.engine_core.abort_requests(ids)
        if not report:
            return
        outs = [
            EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT, stop_reason=reason)
            for r in ids
        ]
        self._send_outputs(EngineCoreOutputs(outputs=outs, finished_requests=set(ids)))

    def send_engine_dead(self, reason: str) -> None:
        self._send_outputs(EngineCoreOutputs(engine_dead=True, dead_reason=reason))

    def close(self) -> None:
        core = getattr(self, "engine_core", None)
        if core is not None:  # stop the rank's workers while they can still answer
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway
                logger.exception("engine %d: shutting the executor down failed", self.engine_id)
        self.output_queue.put(None)
        self._output_thread.join(5)
        self._stop_io.set()
        self._input_thread.join(2)
        self._handshake.close(linger_ms=500)
        self.ctx.term()
        self._launcher.close()


class _StartSignals:
    """SIGTERM/SIGINT during an engine's start: exit at once (``run_engine_core``)."""

    def __init__(self, engine_id: int) -> None:
        self.engine_id = engine_id
        self._lock = threading.Lock()
        self._started = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="engine-start-signals", daemon=True).start()

    def _watch(self) -> None:
        stops = {int(signal.SIGTERM), int(signal.SIGINT)}
        try:
            while got := os.read(self._read, 1):  # b"": up() closed the pipe
                with self._lock:  # (any signal with a Python handler writes its number)
                    if got[0] in stops and not self._started:
                        logger.warning(
                            "engine %d: stopped by a signal during its start", self.engine_id
                        )
                        os._exit(0)
        finally:
            os.close(self._read)

    def up(self) -> None:
        """The engine is built: a signal from now on is the busy loop's to act on."""
        with self._lock:
            self._started = True
        signal.set_wakeup_fd(-1)
        os.close(self._write)


def run_engine_core(
    config: EngineConfig,
    engine_id: int,
    handshake_address: str,
    proc_class: type[EngineCoreProc] = EngineCoreProc,
    **kwargs: Any,
) -> None:
    """Process entry point. Exit code 0 on a clean shutdown, 1 on a fatal error.

    ``proc_class``: ``EngineCoreProc`` or ``dp_proc.DPEngineCoreProc`` (the entry module
    picks it: this module is below the DP one and cannot name it)."""
    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "WARNING"))
    set_process_name(f"EngineCore_DP{engine_id}")
    proc: EngineCoreProc | None = None
    pending_signal: list[int] = []
    # Until the busy loop exists, remember a signal and act on it once we're up...
    signal.signal(signal.SIGTERM, lambda s, f: pending_signal.append(s))
    signal.signal(signal.SIGINT, lambda s, f: pending_signal.append(s))
    # ...unless the start is still under way then: it has nothing to drain, and its main
    # thread may sit for minutes in C (a gloo rendezvous with ranks that never come),
    # where Python's handler cannot run. So the signal's byte on the wakeup fd, written
    # the moment it arrives, is watched by a thread that ends the start at once.
    start = _StartSignals(engine_id)
    exit_code = 0
    try:
        proc = proc_class(config, engine_id, handshake_address, **kwargs)
        start.up()
        signal.signal(signal.SIGTERM, proc.request_shutdown)
        signal.signal(signal.SIGINT, proc.request_shutdown)
        if pending_signal:
            proc.request_shutdown()
        proc.run_busy_loop()
    except EngineStartupError as e:
        logger.error("%s", e)
        exit_code = 1
    except Exception as e:  # noqa: BLE001 - fatal: tell the clients, then exit non-zero
        logger.error("engine %d died: %s", engine_id, traceback.format_exc())
        if proc is not None:
            proc.send_engine_dead(f"engine {engine_id} died: {type(e).__name__}: {e}")
        exit_code = 1
    finally:
        if proc is not None:
            proc.close()
    os._exit(exit_code)  # skip interpreter teardown of torch / zmq threads
