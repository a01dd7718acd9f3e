"""The Ray actor that is one engine rank's home on a Ray node (``launchers/ray.py`` places
and drives it).

The actor runs no model: it starts the rank's engine process beside itself on its node
(``python -m tidal.engine_core.entry``, or a fork of a warm launcher it started ahead),
reports its pid, waits for its exit and signals it. The engine then speaks Tidal's own
protocols (handshake, ZMQ with CURVE over TCP, TCPStore, gloo/NCCL) exactly as a rank of
a ``--headless`` host does; Ray only places, starts, watches and stops.

Why a child process and not the engine inside the actor: the engine is the same program
whichever launcher runs it (its signals, its TP worker processes, its exit codes), and the
actor stays answerable while the engine is frozen or stuck, so ``kill`` works on it
(docs/architecture.md#faults). Fate: the engine watches its launcher, which is this actor (its pid is
in the launch payload); the actor dies with its owner (the frontend's Ray driver) or its
node, so no engine outlives its deployment.

This module is imported by Ray worker processes: it imports nothing heavy (no torch), so
an actor starts in the time Ray takes to hand it a worker.
"""

from __future__ import annotations

import os
import socket
import threading

import ray

from tidal.distributed.ports import get_open_port
from tidal.utils.cpu_threads import engine_process_env, usable_cores
from tidal.utils.forkserver import ForkedProcess, ForkServer
from tidal.utils.procs import ModuleProcess

# A warm launcher still importing is waited for this long (a cold start would import too).
WARM_READY_TIMEOUT_S = 10.0


class EngineActor:
    """One engine rank on a Ray node. Methods run on the actor's thread pool
    (``max_concurrency``), so ``wait_exit`` blocks one thread while ``signal`` answers.

    States: created (``zygote_module`` given: a warm launcher importing the engine) ->
    started (``start``: the engine process runs) -> exited (``wait_exit`` returns its code).
    A second ``start`` is refused: one actor, one engine."""

    def __init__(self, zygote_module: str | None, cpus: int) -> None:
        # The node's cores in shares of the CPUs this rank reserved: the engine takes one
        # share (``data_parallel_size_local``, ``engine_process_env``), so it runs as many
        # threads as it has CPUs, beside the node's other ranks and Ray's other work.
        self._local_ranks = max(1, usable_cores() // max(1, cpus))
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._proc: ModuleProcess | ForkedProcess | None = None
        self._zygote = (
            ForkServer(zygote_module, "EngineZygote", env=self._env()) if zygote_module else None
        )

    def _env(self) -> dict[str, str]:
        """The engine's OpenMP settings: its share of this node's cores."""
        return engine_process_env(os.environ, cores=usable_cores(), local_ranks=self._local_ranks)

    def info(self) -> dict[str, object]:
        """Where this actor runs: its pid, Ray node id, node IP and host name, and the
        ``data_parallel_size_local`` its engine takes its thread count from."""
        ctx = ray.get_runtime_context()
        return {
            "local_ranks": self._local_ranks,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
        }

    def free_port(self, host: str) -> int:
        """A port free a moment ago on this node's ``host`` (for a store rank 0 hosts)."""
        return get_open_port(host)

    def warm_up(self, timeout_s: float) -> bool:
        """Whether the warm launcher has its imports done (waits up to ``timeout_s``)."""
        return self._zygote is not None and self._zygote.wait_ready(timeout_s)

    def start(self, name: str, payload: bytes, entry_module: str) -> tuple[int, bool]:
        """Start the engine process (``EngineLaunch`` on its stdin): its pid, and whether
        the warm launcher forked it (else a fresh interpreter: none, or not ready)."""
        with self._lock:
            if self._proc is not None:
                raise RuntimeError(f"this actor already runs {self._proc.name}")
            proc: ModuleProcess | ForkedProcess | None = None
            if self._zygote is not None and self._zygote.wait_ready(WARM_READY_TIMEOUT_S):
                try:
                    proc = self._zygote.spawn(name, payload, WARM_READY_TIMEOUT_S)
                except RuntimeError:  # gone or stuck: a cold start still works
                    proc = None
            if proc is None:
                proc = ModuleProcess(entry_module, name, payload, env=self._env())
            self._proc = proc
        self._started.set()
        return proc.pid, isinstance(proc, ForkedProcess)

    def wait_exit(self) -> int | None:
        """Block until the engine process exits; its exit code (negative: the signal)."""
        self._started.wait()
        assert self._proc is not None
        self._proc.join()
        return self._proc.exitcode

    def signal(self, kill: bool) -> None:
        """SIGTERM (the engine drains, then exits) or SIGKILL the engine process."""
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill() if kill else proc.terminate()
