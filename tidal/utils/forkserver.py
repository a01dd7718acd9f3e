"""A warm process launcher: a child that imports once, then forks a process per request.

Why: a fresh engine process spends most of its startup importing (torch, transformers:
about 1.4 s of CPU, several seconds on a loaded 2-core machine), which dominated elastic
scale-up. The *zygote* (``python -P -m <module>``, started like a ``ModuleProcess``, so the
caller's ``__main__`` is never re-imported) imports the engine once and forks a child per
request; the child starts with everything imported and runs the launch payload.

Fork safety: the zygote is single-threaded and creates no threads, sockets or CUDA
context before forking (importing torch creates none of these); each child builds its own.

Wire (an ``AF_UNIX`` ``SOCK_SEQPACKET`` pair, msgpack, never pickle):

- launcher -> zygote: ``[request_id, payload]`` with one file descriptor attached, the
  write end of a pipe that the child keeps open for its whole life: the launcher's read
  end hits EOF exactly when the child has exited (the *sentinel*, as for
  ``multiprocessing.connection.wait``);
- zygote -> launcher: ``["spawned", request_id, pid]`` right after the fork, and
  ``["exit", pid, exitcode]`` when it reaped the child (negative: killed by that signal).

Lifetime: the zygote exits when the launcher's end of the pair closes (the launcher
closed it or died); its children then notice their parent changed (``os.getppid()``) and
leave, as engines do when their launcher dies. Each child runs in its own process group,
like a ``ModuleProcess``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping

import msgspec

from tidal.utils.procs import _child_env

_MAX_MESSAGE = 1 << 26  # a launch payload (config + HF config dict) is a few KB


class ForkedProcess:
    """A zygote's child, with the interface process managers use (as ``ModuleProcess``):
    ``name``, ``pid``, ``sentinel``, ``is_alive()``, ``exitcode``, ``terminate()``,
    ``kill()``, ``join(timeout)``, ``close()``."""

    def __init__(self, name: str, pid: int, sentinel: int) -> None:
        self.name = name
        self.pid = pid
        self.sentinel = sentinel
        self._exitcode: int | None = None
        self._done = threading.Event()
        self._closed = False

    def _exited(self, code: int) -> None:
        self._exitcode = code
        self._done.set()

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and _readable(self.sentinel):
            # Exited; the zygote's report of the code follows within moments.
            self._done.wait(2.0)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def _signal(self, sig: int) -> None:
        if self._exitcode is None:  # never signal a pid the zygote has reaped (reuse)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.sentinel)

    def __repr__(self) -> str:
        state = "alive" if self._exitcode is None else f"exitcode={self._exitcode}"
        return f"<ForkedProcess {self.name} pid={self.pid} {state}>"


class ForkServer:
    """The launcher's side: start the zygote (``python -P -m module name FD``), then
    ``spawn(name, payload)`` returns a ``ForkedProcess`` in milliseconds."""

    def __init__(self, module: str, name: str, env: Mapping[str, str] | None = None) -> None:
        # env: added to the zygote's environment, which every forked child shares (what
        # the OpenMP runtime reads when torch loads, in the zygote, must be there).
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-P", "-m", module, name, str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=_child_env(env),
                process_group=0,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self._popen.pid
        self._sock = ours
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        # request id -> (name, sentinel read end, event, [the process once spawned])
        self._pending: dict[int, tuple[str, int, threading.Event, list[ForkedProcess]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._closed and self._popen.poll() is None

    def spawn(self, name: str, payload: bytes, timeout_s: float = 60.0) -> ForkedProcess:
        """Fork a child that runs ``payload``. Raises ``RuntimeError`` if the zygote is
        gone or does not answer within ``timeout_s`` (it may still be importing)."""
        if not self.alive:
            raise RuntimeError("the fork server is not running")
        r, w = os.pipe()
        request = next(self._ids)
        done = threading.Event()
        slot: list[ForkedProcess] = []
        with self._lock:
            self._pending[request] = (name, r, done, slot)
        try:
            socket.send_fds(self._sock, [msgspec.msgpack.encode([request, payload])], [w])
        except OSError as e:
            with self._lock:
                self._pending.pop(request, None)
            os.close(r)
            raise RuntimeError(f"the fork server is gone: {e}") from e
        finally:
            os.close(w)  # the child holds its own copy; EOF on r when it exits
        if not done.wait(timeout_s) or not slot:
            with self._lock:
                entry = self._pending.pop(request, None)
            if entry is not None:
                os.close(r)
            raise RuntimeError(f"the fork server did not start {name} within {timeout_s:g}s")
        return slot[0]

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = msgspec.msgpack.decode(data)
            if msg[0] == "spawned":
                _, request, pid = msg
                with self._lock:
                    entry = self._pending.pop(request, None)
                    if entry is None:
                        continue
                    name, r, done, slot = entry
                    proc = ForkedProcess(name, pid, r)
                    self._children[pid] = proc
                slot.append(proc)
                done.set()
            elif msg[0] == "exit":
                _, pid, code = msg
                with self._lock:
                    proc = self._children.pop(pid, None)
                if proc is not None:
                    proc._exited(code)
        # The zygote is gone: whoever waits for a spawn fails now, not at its timeout.
        with self._lock:
            pending, self._pending = self._pending, {}
        for _, r, done, _slot in pending.values():
            os.close(r)
            done.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the zygote (its children are the caller's to stop first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # EOF for the zygote and our reader
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
        self._reader.join(timeout_s)
        self._sock.close()


def serve_forks(channel_fd: int, run_child: Callable[[bytes], None]) -> None:
    """The zygote's loop (after its imports): fork ``run_child(payload)`` per request and
    report the children's exits, until the launcher's end of the channel closes."""
    sock = socket.socket(fileno=channel_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd fires
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is sock:
                    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
                    if not data:
                        return  # the launcher closed its end, or died
                    request, payload = msgspec.msgpack.decode(data)
                    pid = os.fork()
                    if pid == 0:  # the child: drop the zygote's plumbing, then run
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        sel.close()
                        sock.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        os.setpgid(0, 0)
                        try:
                            run_child(payload)  # keeps fds[0] open until it exits
                        finally:
                            os._exit(1)
                    for fd in fds:
                        os.close(fd)
                    sock.send(msgspec.msgpack.encode(["spawned", request, pid]))
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    _reap(sock)
    finally:
        sel.close()


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            sock.send(msgspec.msgpack.encode(["exit", pid, os.waitstatus_to_exitcode(status)]))


def _readable(fd: int) -> bool:
    sel = selectors.DefaultSelector()
    try:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(0))
    finally:
        sel.close()
