"""EngineCoreProc: an EngineCore in its own process, with ZMQ I/O threads around it.

Threads:
- input thread: DEALER (identity = engine index, 2 bytes little-endian) -> ``input_queue``
- busy loop (main thread): owns the scheduler alone; drains the queue, steps the engine
- output thread: ``output_queue`` -> PUSH

Startup handshake (on a separate DEALER to the frontend's handshake ROUTER):
  engine: HELLO(index, pid) -> frontend: addresses + parallel config hash
  engine: connects, registers on the input socket, loads the model
  engine: READY(index, its own config hash, num_blocks) or READY(error=...) on failure.
A rank whose parallel config differs from the frontend's fails fast with a clear error.
Over TCP (multi-node) every socket here is a CURVE client keyed by the deployment's shared
secret (``tidal/utils/zmq_auth.py``); a rank whose secret differs sees the frontend refuse
its handshake and fails fast too, instead of waiting out the handshake timeout.

Shutdown: RUNNING -(SIGTERM/SIGINT)-> REQUESTED -> SHUTTING_DOWN (stop admitting, drain
for up to ``drain_timeout_s``, then abort what is left) -> exit. A fatal error sends an
``EngineCoreOutputs(engine_dead=True)`` before exiting so clients fail fast.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import re
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from tidal.config import EngineConfig
from tidal.engine_core.core import EngineCore
from tidal.engine_core.messages import (
    EngineAddresses,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHello,
    EngineReady,
    FinishReason,
    StartDPWave,
    UtilityOutput,
    UtilityRequest,
    encode,
)
from tidal.utils.proctitle import set_process_name
from tidal.utils.zmq_auth import (
    AuthenticationError,
    curve_keys,
    raise_if_refused,
    secure_client,
    watch_handshake,
)

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 60.0
TO_CLIENT, TO_COORDINATOR = 0, 1
# How long the idle busy loop blocks on its queue before re-checking shutdown flags.
_IDLE_POLL_S = 0.05


@enum.unique
class ShutdownState(enum.Enum):
    RUNNING = enum.auto()
    REQUESTED = enum.auto()
    SHUTTING_DOWN = enum.auto()


class EngineStartupError(RuntimeError):
    pass


def engine_identity(engine_index: int) -> bytes:
    return engine_index.to_bytes(2, "little")


_REQUEST_DECODERS = {
    EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
    EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(UtilityRequest),
}
_ADD_FIELDS = EngineCoreRequest.__struct_fields__


@dataclass(frozen=True)
class UndecodableRequest:
    """An ADD whose payload did not decode (stays inside this process). It never reaches
    the scheduler; it is answered with an error when its id can be read, and under data
    parallelism it still counts as a request for the wave: the frontend may have woken
    the other ranks for it, and they would wait in a collective for this one."""

    request_id: str | None
    current_wave: int
    reason: str

    @classmethod
    def from_payload(cls, payload: bytes, error: Exception) -> UndecodableRequest:
        fields: Any = None
        try:
            fields = msgspec.msgpack.decode(payload)  # untyped: just find the id and wave
        except Exception:  # noqa: BLE001 - not even msgpack: nothing to answer
            pass
        if not isinstance(fields, list):
            fields = []
        rid = fields[0] if fields and isinstance(fields[0], str) else None
        i = _ADD_FIELDS.index("current_wave")
        wave = fields[i] if len(fields) > i and type(fields[i]) is int else 0
        return cls(rid, wave, f"the engine could not decode the request: {_named(error)}")


_PATH = re.compile(r"`\$((?:\[\d+\])+)`")


def _named(error: Exception) -> str:
    """msgspec's error with its array path (``$[2][3]``: requests are array_like) given
    as field names (``sampling_params.top_k``), so the message names the field."""

    def name(match: re.Match) -> str:
        t: Any = EngineCoreRequest
        parts = []
        for index in map(int, re.findall(r"\d+", match.group(1))):
            fields = (
                msgspec.structs.fields(t)
                if isinstance(t, type) and issubclass(t, msgspec.Struct)
                else ()
            )
            if index < len(fields):
                parts.append(fields[index].name)
                t = fields[index].type
            else:
                parts.append(f"[{index}]")
                t = None
        return "`" + ".".join(parts).replace(".[", "[") + "`"

    return _PATH.sub(name, str(error))


class EngineCoreProc:
    """One engine core process. ``run_engine_core`` is the process entry point."""

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int,
        handshake_address: str,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        self.drain_timeout_s = drain_timeout_s
        self.shutdown_state = ShutdownState.RUNNING
        self._drain_deadline = 0.0
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        # (destination, outputs): TO_CLIENT or TO_COORDINATOR; None stops the thread.
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self._stop_io = threading.Event()
        self.coordinator_ready = threading.Event()
        self.coordinator_wave = 0
        tcp = handshake_address.startswith("tcp://")
        self._curve = curve_keys(config.parallel.data_parallel_auth_key) if tcp else None
        self._handshake = self.ctx.socket(zmq.DEALER)
        self._handshake.setsockopt(zmq.LINGER, 1000)
        secure_client(self._handshake, self._curve, handshake_address)
        monitor = watch_handshake(self._handshake) if self._curve is not None else None
        self._handshake.connect(handshake_address)
        try:
            self.addresses = self._hello(monitor)
        except BaseException:
            self._close_monitor(monitor)
            self._handshake.close()  # lingers long enough to deliver a READY(error)
            self.ctx.term()
            raise
        self._close_monitor(monitor)
        if self.addresses.dp_master_port:
            self.config = config.with_parallel(
                data_parallel_master_port=self.addresses.dp_master_port
            )
        self._start_io_threads()
        try:
            self.engine_core = self._build_engine_core()
        except Exception as e:
            self._send_ready(0, error=f"{type(e).__name__}: {e}")
            raise
        self._send_ready(self.engine_core.num_blocks)

    # ---- startup -----------------------------------------------------------------------

    def _hello(self, monitor: zmq.Socket | None) -> EngineAddresses:
        self._handshake.send(encode(EngineHello(self.engine_index, os.getpid())))
        self._await_reply(monitor)
        addresses = msgspec.msgpack.decode(self._handshake.recv(), type=EngineAddresses)
        mine = self.config.config_hash()
        if addresses.parallel_config_hash and addresses.parallel_config_hash != mine:
            msg = (
                f"engine {self.engine_index}: parallel config mismatch (frontend "
                f"{addresses.parallel_config_hash}, this rank {mine}): all ranks must be started "
                "with the same --data-parallel-size / expert-parallel / backend flags"
            )
            self._send_ready(0, error=msg)
            raise EngineStartupError(msg)
        return addresses

    def _close_monitor(self, monitor: zmq.Socket | None) -> None:
        if monitor is not None:
            self._handshake.disable_monitor()
            monitor.close(linger=0)

    def _await_reply(self, monitor: zmq.Socket | None) -> None:
        """Wait for the frontend's reply to HELLO; with CURVE, also for a refused
        handshake on ``monitor``, which means a different secret: fail at once."""
        poller = zmq.Poller()
        poller.register(self._handshake, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if monitor is not None and monitor in ready:
                try:
                    raise_if_refused(monitor, "the frontend")
                except AuthenticationError as e:
                    raise EngineStartupError(f"engine {self.engine_index}: {e}") from None
            if self._handshake in ready:
                return
        raise EngineStartupError(
            f"engine {self.engine_index}: no reply from the frontend within {HANDSHAKE_TIMEOUT_S}s"
        )

    def _build_engine_core(self) -> EngineCore:
        return EngineCore(self.config)

    def _send_ready(self, num_blocks: int, error: str | None = None) -> None:
        ready = EngineReady(self.engine_index, self.config.config_hash(), num_blocks, error)
        self._handshake.send(encode(ready))

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
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, engine_identity(self.engine_index))
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
        parent = os.getppid()
        try:
            while not self._stop_io.is_set():
                if os.getppid() != parent:
                    # The launcher died without stopping us (SIGKILL): don't linger as an orphan.
                    self._on_launcher_death()
                for ready, _ in poller.poll(100):
                    if ready is sock:
                        self._read_client_request(sock)
                    else:
                        self._read_coordinator_message(coord)
        finally:
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

    def _read_client_request(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=False)
        kind = bytes(frames[0].buffer)
        try:
            req_type = EngineCoreRequestType(kind)
            payload = _REQUEST_DECODERS[req_type].decode(frames[1].buffer)
        except Exception as e:  # noqa: BLE001 - a bad message must not kill this thread
            if kind == EngineCoreRequestType.ADD.value and len(frames) > 1:
                bad = UndecodableRequest.from_payload(bytes(frames[1].buffer), e)
                self.input_queue.put_nowait((EngineCoreRequestType.ADD, bad))
            else:
                logger.error("engine %d: dropped an undecodable message: %s", self.engine_index, e)
            return
        self.input_queue.put_nowait((req_type, payload))

    def _read_coordinator_message(self, sub: zmq.Socket) -> None:
        from tidal.dp_coordinator.proc import decode_engine_message

        frames = sub.recv_multipart()
        try:
            msg = decode_engine_message(frames)
        except Exception as e:  # noqa: BLE001 - a bad message must not kill this thread
            logger.error("engine %d: dropped a bad coordinator message: %s", self.engine_index, e)
            return
        if isinstance(msg, StartDPWave):
            self.input_queue.put_nowait((EngineCoreRequestType.START_DP_WAVE, msg))
        elif not self.coordinator_ready.is_set():
            # The first READY proves our subscription is live (no lost START_DP_WAVE).
            self.coordinator_wave = msg.wave
            self.coordinator_ready.set()

    def _output_loop(self) -> None:
        socks = {TO_CLIENT: self._push_socket(self.addresses.output_address)}
        if self.addresses.coordinator_output:
            socks[TO_COORDINATOR] = self._push_socket(self.addresses.coordinator_output)
        try:
            while True:
                item = self.output_queue.get()
                if item is None:
                    break
                dest, outputs = item
                socks[dest].send(encode(outputs))
        finally:
            for sock in socks.values():
                sock.close()

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
        if not self._has_work() and self.shutdown_state is ShutdownState.RUNNING:
            try:
                item = self.input_queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                return
            self._handle_client_request(*item)
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_client_request(*item)

    def _has_work(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def _process_engine_step(self) -> bool:
        outputs, executed = self.engine_core.step()
        for client_outputs in outputs.values():
            self._send_outputs(client_outputs)
        return executed

    def _send_outputs(self, outputs: EngineCoreOutputs, dest: int = 0) -> None:
        outputs.engine_index = self.engine_index
        outputs.timestamp = time.monotonic()
        self.output_queue.put_nowait((dest, outputs))

    def _handle_client_request(self, req_type: EngineCoreRequestType, payload: Any) -> None:
        if req_type is EngineCoreRequestType.ADD:
            self._add_request(payload)
        elif req_type is EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif req_type is EngineCoreRequestType.UTILITY:
            self._call_utility(payload)
        elif req_type is EngineCoreRequestType.START_DP_WAVE:
            self._start_wave(payload)

    def _add_request(self, req: EngineCoreRequest | UndecodableRequest) -> None:
        if isinstance(req, UndecodableRequest):
            logger.error("engine %d: %s", self.engine_index, req.reason)
            if req.request_id is not None:
                self._reject(req.request_id, req.reason)
            return
        if self.shutdown_state is not ShutdownState.RUNNING:
            self._reject(req.request_id, "engine is shutting down", FinishReason.ABORT)
            return
        try:
            self.engine_core.add_request(req)
        except Exception as e:  # noqa: BLE001 - any failure to admit fails this request alone
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            self._reject(req.request_id, msg)

    def _reject(
        self, request_id: str, reason: str, finish_reason: FinishReason = FinishReason.ERROR
    ) -> None:
        out = EngineCoreOutput(request_id, [], finish_reason=finish_reason, stop_reason=reason)
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
        self._send_outputs(EngineCoreOutputs(utility_output=result))

    def _start_wave(self, msg: StartDPWave) -> None:
        """Data parallel only (see DPEngineCoreProc)."""

    # ---- shutdown ----------------------------------------------------------------------

    def request_shutdown(self, *_: Any) -> None:
        if self.shutdown_state is ShutdownState.RUNNING:
            self.shutdown_state = ShutdownState.REQUESTED

    def _on_launcher_death(self) -> None:
        if not hasattr(self, "engine_core"):
            # Still starting: the main thread may wait minutes in the group rendezvous for
            # ranks that will never come, and there is nothing to drain. Leave now.
            logger.error("engine %d: launcher gone during startup, exiting", self.engine_index)
            os._exit(1)
        # Nobody is left to read what a drain would produce: leave without one. The
        # timeout is zeroed before the request so the busy loop never sets a later deadline.
        self.drain_timeout_s = 0.0
        self._drain_deadline = 0.0
        self.request_shutdown()

    def _shutdown_done(self) -> bool:
        if self.shutdown_state is ShutdownState.RUNNING:
            return False
        if self.shutdown_state is ShutdownState.REQUESTED:
            self.shutdown_state = ShutdownState.SHUTTING_DOWN
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
        if self._has_work() and time.monotonic() < self._drain_deadline:
            return False
        self._abort_all("engine shut down before the request finished")
        return True

    def _abort_all(self, reason: str) -> None:
        ids = self.engine_core.scheduler.unfinished_request_ids()
        if not ids:
            return
        self.engine_core.abort_requests(ids)
        outs = [
            EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT, stop_reason=reason)
            for r in ids
        ]
        self._send_outputs(EngineCoreOutputs(outputs=outs, finished_requests=set(ids)))

    def send_engine_dead(self, reason: str) -> None:
        self._send_outputs(EngineCoreOutputs(engine_dead=True, dead_reason=reason))

    def close(self) -> None:
        self.output_queue.put(None)
        self._output_thread.join(5)
        self._stop_io.set()
        self._input_thread.join(2)
        self._handshake.close(linger=500)
        self.ctx.term()


# How often the ranks of a running wave all-reduce "does anyone still have work?".
DP_ALLREDUCE_INTERVAL = 32
COORDINATOR_READY_TIMEOUT_S = 30.0


class DPEngineCoreProc(EngineCoreProc):
    """A data-parallel rank: the wave-synchronised busy loop of DESIGN.md section 3.

    While a wave runs every rank steps, idle ones with dummy batches, so expert-parallel
    collectives stay matched; every ``DP_ALLREDUCE_INTERVAL`` steps the ranks all-reduce
    ``[has_unfinished, pending_pause]`` over the DP group. The wave protocol (who starts a
    wave, which races exist) lives in ``tidal.dp_coordinator.state``; this class applies
    ``EngineWaveState``'s decisions.

    Two-phase pause (the group stops stepping at one agreed step, e.g. before a
    reconfiguration): phase 1, ``pause`` sets ``pending_pause`` on a rank and, if the group
    is idle, starts a wave so every rank reaches the next all-reduce; phase 2, that
    all-reduce shows the flag to every rank at the same step and they all pause together,
    requests staying queued. While paused a rank still records START_DP_WAVE (so a rank
    resumed earlier than another waits for it in the next collective instead of running
    alone); ``resume`` clears the pause and restarts the wave if there is work.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from tidal.dp_coordinator.state import EngineWaveState

        super().__init__(*args, **kwargs)
        self.wave = EngineWaveState(self.engine_index, self.coordinator_wave)
        self.step_counter = 0
        self.pending_pause = False
        self.paused = False
        self.num_dummy_batches = 0
        self._last_published: tuple[int, int] | None = None

    def _build_engine_core(self) -> EngineCore:
        if self.addresses.coordinator_input and not self.coordinator_ready.wait(
            COORDINATOR_READY_TIMEOUT_S
        ):
            raise EngineStartupError(
                f"engine {self.engine_index}: no READY from the DP coordinator within "
                f"{COORDINATOR_READY_TIMEOUT_S}s"
            )
        return super()._build_engine_core()

    @property
    def dp_group(self) -> Any:
        return self.engine_core.executor.worker.dp_group

    def run_busy_loop(self) -> None:
        while True:
            # 1. Drain the input queue (blocks only when idle and no wave is running).
            self._process_input_queue()
            if self.paused:  # the group agreed to pause: requests stay queued
                if self._shutdown_done():
                    return
                continue
            # 2. Step the engine; publish (waiting, running) when it changed.
            executed = self._process_engine_step()
            self._publish_load_if_changed()
            if not self.wave.running:
                if self._shutdown_done():
                    return
                continue
            # 3. Nothing ran but the wave is running: a dummy forward keeps collectives matched.
            if not executed:
                self.engine_core.execute_dummy_batch()
                self.num_dummy_batches += 1
            # 4. Every DP_ALLREDUCE_INTERVAL steps, agree whether anyone still has work.
            if not self._group_has_work():
                # 5. The group is idle: end the wave (rank 0 reports it) and pause.
                self._end_wave()
            # 6. On shutdown, leave between waves (or at the drain deadline): leaving
            #    mid-wave would strand the other ranks in a collective.
            if self._shutdown_done():
                return

    def _has_work(self) -> bool:
        if self.paused:
            return False
        return self.engine_core.has_unfinished_requests() or self.wave.running

    def utility_pause(self) -> bool:
        """Phase 1 of a group pause (call on every rank)."""
        self.pending_pause = True
        if not self.wave.running and not self.paused:
            self._run_wave()
        return True

    def utility_resume(self) -> bool:
        self.pending_pause = False
        self.paused = False
        if self.engine_core.has_unfinished_requests() and not self.wave.running:
            self._run_wave()
        return True

    def _run_wave(self) -> None:
        """Start running the current wave and make the coordinator start the others."""
        self.wave.on_request(self.wave.wave)
        self._send_outputs(EngineCoreOutputs(start_wave=self.wave.wave), TO_COORDINATOR)

    def utility_dp_state(self) -> dict[str, Any]:
        """For tests and debugging: this rank's view of the wave."""
        return {
            "rank": self.engine_index,
            "wave": self.wave.wave,
            "running": self.wave.running,
            "step_counter": self.step_counter,
            "dummy_batches": self.num_dummy_batches,
            "paused": self.paused,
        }

    def _group_has_work(self) -> bool:
        self.step_counter += 1
        if self.step_counter % DP_ALLREDUCE_INTERVAL:
            return True
        import torch

        flags = torch.tensor(
            [int(self.engine_core.has_unfinished_requests()), int(self.pending_pause)],
            dtype=torch.int32,
        )  # [2] int32, CPU: gloo
        self.dp_group.all_reduce(flags)
        if flags[1].item():
            self.paused = True  # phase 2: every rank sees the flag at this same step
            return False
        return bool(flags[0].item())

    def _end_wave(self) -> None:
        completed = self.wave.on_wave_end()
        self.step_counter = 0
        if self.engine_index == 0:
            self._send_outputs(EngineCoreOutputs(wave_complete=completed), TO_COORDINATOR)

    def _add_request(self, req: EngineCoreRequest | UndecodableRequest) -> None:
        if self.paused:  # queued; resume starts the wave
            super()._add_request(req)
            return
        start = self.wave.on_request(req.current_wave)
        if start is not None:
            self._send_outputs(EngineCoreOutputs(start_wave=start), TO_COORDINATOR)
        super()._add_request(req)

    def _start_wave(self, msg: StartDPWave) -> None:
        self.wave.on_start_wave(msg)

    def _publish_load_if_changed(self) -> None:
        sched = self.engine_core.scheduler
        load = (sched.num_waiting, sched.num_running)
        if load != self._last_published:
            self._last_published = load
            self._send_outputs(
                EngineCoreOutputs(scheduler_stats=sched.make_stats()), TO_COORDINATOR
            )


def run_engine_core(
    config: EngineConfig,
    engine_index: int,
    handshake_address: str,
    proc_class: type[EngineCoreProc] = EngineCoreProc,
    **kwargs: Any,
) -> None:
    """Process entry point. Exit code 0 on a clean shutdown, 1 on a fatal error."""
    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "WARNING"))
    set_process_name(f"EngineCore_DP{engine_index}")
    if proc_class is EngineCoreProc and config.parallel.data_parallel_size > 1:
        proc_class = DPEngineCoreProc
    proc: EngineCoreProc | None = None
    pending_signal: list[int] = []
    # Until the busy loop exists, remember a signal and act on it once we're up.
    signal.signal(signal.SIGTERM, lambda s, f: pending_signal.append(s))
    signal.signal(signal.SIGINT, lambda s, f: pending_signal.append(s))
    exit_code = 0
    try:
        proc = proc_class(config, engine_index, handshake_address, **kwargs)
        signal.signal(signal.SIGTERM, proc.request_shutdown)
        signal.signal(signal.SIGINT, proc.request_shutdown)
        if pending_signal:
            proc.request_shutdown()
        proc.run_busy_loop()
    except EngineStartupError as e:
        logger.error("%s", e)
        exit_code = 1
    except Exception as e:  # noqa: BLE001 - fatal: tell the clients, then exit non-zero
        logger.error("engine %d died: %s", engine_index, traceback.format_exc())
        if proc is not None:
            proc.send_engine_dead(f"engine {engine_index} died: {type(e).__name__}: {e}")
        exit_code = 1
    finally:
        if proc is not None:
            proc.close()
    os._exit(exit_code)  # skip interpreter teardown of torch / zmq threads
