"""A warm process launcher: a child that imports once, then forks a process per request.

Why: a fresh engine process spends most of its startup importing (torch, transformers:
about 1.4 s of CPU, several seconds on a loaded 2-core machine), which dominated elastic
scale-up. The *zygote* (``python -P -m <module>``, started like a ``ModuleProcess``, so the
caller's ``__main__`` is never re-imported) imports the engine once and forks a child per
request; the child starts with everything imported and runs the launch payload.

Fork safety: the zygote is single-threaded and creates no threads, sockets or CUDA
context before forking (importing torch creates none of these); each child builds its own.

Wire (an ``AF_UNIX`` ``SOCK_SEQPACKET`` pair, msgpack, never pickle):

- zygote -> launcher: ``["ready"]`` once its imports are done (before that a spawn would
  wait for them: the launcher starts cold instead);
- launcher -> zygote: ``["spawn", request_id, deadline, payload]`` with one file descriptor
  attached, the write end of a pipe that the child keeps open for its whole life: the
  launcher's read end hits EOF exactly when the child has exited (the *sentinel*, as for
  ``multiprocessing.connection.wait``). ``deadline`` is on ``time.monotonic()`` (one clock
  for every process of a host): a request the zygote reads after it is refused;
- zygote -> launcher: ``["spawned", request_id, pid]`` right after the fork, with a pidfd
  of the child attached where the kernel has them (signals then reach exactly that child,
  whoever reaps it), or ``["expired", request_id]``; ``["exit", pid, exitcode]`` when it
  reaped a child (negative: killed by that signal);
- launcher -> zygote: ``["cancel", request_id]`` after a spawn timed out; the zygote reads
  requests in order, so the spawn was handled before: a child it forked for it is
  SIGKILLed. Answer ``["cancelled", request_id, pid or 0]``;
- ``["ping", n]`` -> ``["pong", n]``: a zygote that stops answering is frozen
  (``unresponsive``), and its keeper kills and replaces it (docs/architecture.md#faults).

Lifetime: the zygote exits when the launcher's end of the pair closes (the launcher
closed it or died). Its children are the *launcher's* processes: they watch the launcher,
not their parent (``ProcessWatch``), and keep running if the zygote dies -- their
sentinels and pidfds still work; only their exit codes are lost with it
(``EXIT_CODE_UNKNOWN``). Each child runs in its own process group, like a
``ModuleProcess``.

Races:
1. A spawn that times out while the fork happens: the cancel (read after the spawn) kills
   the child, and the deadline refuses a request read too late, so a timed-out spawn
   leaves no child running. If the zygote does not answer the cancel either (frozen), a
   child it may have forked before freezing is unknown here: the caller must refuse a
   process it did not get a pid for (the engine handshake checks the pid).
2. A late ``spawned`` for a request nobody waits for any more: the child is killed at once.
3. The zygote dies with spawns pending: they fail at once, not at their timeout.
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
import time
from collections.abc import Callable, Mapping

import msgspec

from tidal.utils.procs import _child_env, _pidfd_supported

_MAX_MESSAGE = 1 << 26  # a launch payload (config + HF config dict) is a few KB
# The exit code of a child whose zygote died before it: nobody could reap it for us.
EXIT_CODE_UNKNOWN = -256
# How long a cancel may take to be answered before the spawn gives up on it.
CANCEL_WAIT_S = 2.0


class ForkedProcess:
    """A zygote's child, with the interface process managers use (as ``ModuleProcess``):
    ``name``, ``pid``, ``sentinel``, ``is_alive()``, ``exitcode``, ``terminate()``,
    ``kill()``, ``join(timeout)``, ``close()``."""

    def __init__(
        self, name: str, pid: int, sentinel: int, pidfd: int | None, server_gone: threading.Event
    ) -> None:
        self.name = name
        self.pid = pid
        self.sentinel = sentinel
        self._pidfd = pidfd
        self._server_gone = server_gone  # set once the zygote can report nothing more
        self._exitcode: int | None = None
        self._done = threading.Event()
        self._closed = False

    def _exited(self, code: int) -> None:
        if self._exitcode is None:
            self._exitcode = code
        self._done.set()

    def _settle(self, wait_s: float) -> None:
        """The sentinel says it exited: take the zygote's report (it follows within
        moments), or, with the zygote gone, a code nobody can know."""
        if self._exitcode is not None or self._closed or not _readable(self.sentinel):
            return
        if not self._server_gone.is_set():
            self._done.wait(wait_s)
        if self._exitcode is None and self._server_gone.is_set():
            self._exited(EXIT_CODE_UNKNOWN)

    @property
    def exitcode(self) -> int | None:
        self._settle(2.0)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def _signal(self, sig: int) -> None:
        if self._exitcode is not None:
            return  # never signal a pid that was reaped (reuse)
        with contextlib.suppress(ProcessLookupError, OSError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            elif not self._server_gone.is_set():  # its reaper is alive: the pid is its own
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._settle(0.0)
            self._done.wait(0.05 if left is None else min(0.05, left))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.sentinel)
            if self._pidfd is not None:
                os.close(self._pidfd)

    def __repr__(self) -> str:
        state = "alive" if self._exitcode is None else f"exitcode={self._exitcode}"
        return f"<ForkedProcess {self.name} pid={self.pid} {state}>"


class _Request:
    """A spawn in flight: its answer, once the reader has it."""

    def __init__(self, name: str, sentinel: int) -> None:
        self.name = name
        self.sentinel = sentinel
        self.done = threading.Event()
        self.proc: ForkedProcess | None = None
        self.refused: str | None = None  # "expired", or why it failed
        self.cancelled = threading.Event()  # the zygote answered the cancel
        self.cancel_sent = False
        self.abandoned = False  # the caller gave up: a late child is killed


class ForkServer:
    """The launcher's side: start the zygote (``python -P -m module name FD``), then
    ``spawn(name, payload)`` returns a ``ForkedProcess`` in milliseconds once ``ready``."""

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
        self._pending: dict[int, _Request] = {}
        self._children: dict[int, ForkedProcess] = {}  # pid -> child, until reaped
        self._closed = False
        # Readable once the zygote exited (it was just started: the pid is its own).
        self.sentinel: int | None = os.pidfd_open(self.pid) if _pidfd_supported() else None
        self.gone = threading.Event()  # the zygote can report nothing more
        self._settled = threading.Event()  # it said "ready", or it is gone
        self._pings = itertools.count(1)
        self._unanswered_since: float | None = None  # first ping not answered yet
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._closed and not self.gone.is_set() and self._popen.poll() is None

    @property
    def ready(self) -> bool:
        """Alive and done importing: a spawn is answered at once."""
        return self._settled.is_set() and self.alive

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the zygote is done importing (True); False at once when it is gone
        or closed first, else after ``timeout_s``."""
        return self._settled.wait(timeout_s) and self.alive

    # ------------------------------------------------------------------ liveness

    def ping(self) -> None:
        """Ask the zygote for a pong (``unresponsive`` judges the answer)."""
        if not self.ready:
            return
        with self._lock:
            if self._unanswered_since is None:
                self._unanswered_since = time.monotonic()
        self._send(["ping", next(self._pings)])

    def unresponsive(self, timeout_s: float, now: float | None = None) -> bool:
        """A ping has been unanswered for ``timeout_s``: the zygote is frozen."""
        since = self._unanswered_since
        return since is not None and (now or time.monotonic()) - since > timeout_s

    def kill(self) -> None:
        """SIGKILL the zygote (frozen); its children live on."""
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()

    # ------------------------------------------------------------------ spawning

    def spawn(self, name: str, payload: bytes, timeout_s: float = 10.0) -> ForkedProcess:
        """Fork a child that runs ``payload``. Raises ``RuntimeError`` if the zygote is
        gone, or does not fork it within ``timeout_s`` (it is then cancelled: see race 1)."""
        if not self.alive:
            raise RuntimeError("the fork server is not running")
        r, w = os.pipe()
        rid = next(self._ids)
        req = _Request(name, r)
        with self._lock:
            self._pending[rid] = req
        deadline = time.monotonic() + timeout_s
        try:
            msg = msgspec.msgpack.encode(["spawn", rid, deadline, payload])
            socket.send_fds(self._sock, [msg], [w])
        except OSError as e:
            with self._lock:
                self._pending.pop(rid, None)
            os.close(r)
            raise RuntimeError(f"the fork server is gone: {e}") from e
        finally:
            os.close(w)  # the child holds its own copy; EOF on r when it exits
        if not req.done.wait(timeout_s + 0.5):
            self._cancel(rid, req)
        with self._lock:
            self._pending.pop(rid, None)
            proc = req.proc
            req.abandoned = proc is None or req.cancel_sent
        if proc is not None and not req.cancel_sent:
            return proc
        if proc is not None:  # forked, then cancelled: the zygote killed it (race 1)
            proc.join(CANCEL_WAIT_S)
            proc.close()  # its sentinel (r) and pidfd
        else:
            os.close(r)
        why = req.refused or "no answer"
        raise RuntimeError(f"the fork server did not start {name} within {timeout_s:g}s ({why})")

    def _cancel(self, rid: int, req: _Request) -> None:
        """Race 1: make sure no child of this request runs on (killed by the zygote)."""
        try:
            self._send(["cancel", rid])
        except RuntimeError:
            return
        req.cancel_sent = True
        req.cancelled.wait(CANCEL_WAIT_S)
        if req.refused is None:
            req.refused = "cancelled" if req.cancelled.is_set() else "cancel not answered"

    def _send(self, msg: list) -> None:
        try:
            self._sock.send(msgspec.msgpack.encode(msg))
        except OSError as e:
            raise RuntimeError(f"the fork server is gone: {e}") from e

    # ------------------------------------------------------------------ the reader

    def _read(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, _MAX_MESSAGE, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                break
            try:
                self._on_message(msgspec.msgpack.decode(data), fds)
            except Exception:  # noqa: BLE001 - a bad message must not end the reader
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        # The zygote is gone: whoever waits for a spawn fails now, not at its timeout;
        # its children can report nothing more (their exit codes are unknowable).
        self.gone.set()
        self._settled.set()  # a wait_ready ends now: it will never be ready
        with self._lock:
            pending, self._pending = self._pending, {}
        for req in pending.values():
            req.refused = req.refused or "the fork server died"
            req.done.set()
            req.cancelled.set()

    def _on_message(self, msg: list, fds: list[int]) -> None:
        kind = msg[0]
        with self._lock:
            self._unanswered_since = None  # any message proves it alive
        if kind == "ready":
            self._settled.set()
        elif kind == "spawned":
            _, rid, pid = msg
            pidfd = fds[0] if fds else None
            with self._lock:
                req = self._pending.get(rid)
                if req is None or req.abandoned:
                    late = True
                else:
                    late = False
                    req.proc = ForkedProcess(req.name, pid, req.sentinel, pidfd, self.gone)
                    self._children[pid] = req.proc
            if late or req is None:  # race 2: nobody takes it
                if pidfd is not None:
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    os.close(pidfd)
                return
            req.done.set()
        elif kind == "expired":
            with self._lock:
                req = self._pending.get(msg[1])
            if req is not None:
                req.refused = "its deadline passed before the zygote read it"
                req.done.set()
        elif kind == "cancelled":
            with self._lock:
                req = self._pending.get(msg[1])
            if req is not None:
                req.cancelled.set()
        elif kind == "exit":
            _, pid, code = msg
            with self._lock:
                proc = self._children.pop(pid, None)
            if proc is not None:
                proc._exited(code)
        for fd in fds if kind != "spawned" else ():
            os.close(fd)

    # ------------------------------------------------------------------ stopping

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
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


# ---------------------------------------------------------------------- the zygote


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
    children: dict[int, int] = {}  # request id -> pid, until reaped

    def fork(rid: int, payload: bytes, fds: list[int]) -> None:
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
        children[rid] = pid
        pidfd = None
        if _pidfd_supported():
            with contextlib.suppress(OSError):  # not reaped yet: this is our child
                pidfd = os.pidfd_open(pid)
        msg = msgspec.msgpack.encode(["spawned", rid, pid])
        try:
            socket.send_fds(sock, [msg], [pidfd] if pidfd is not None else [])
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def on_request(msg: list, fds: list[int]) -> None:
        kind = msg[0]
        if kind == "spawn":
            _, rid, deadline, payload = msg
            if time.monotonic() >= deadline:  # race 1: the launcher gave up already
                for fd in fds:
                    os.close(fd)
                sock.send(msgspec.msgpack.encode(["expired", rid]))
                return
            fork(rid, payload, fds)
            return
        for fd in fds:
            os.close(fd)
        if kind == "cancel":
            pid = children.get(msg[1], 0)
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # unreaped: still our child's pid
            sock.send(msgspec.msgpack.encode(["cancelled", msg[1], pid]))
        elif kind == "ping":
            sock.send(msgspec.msgpack.encode(["pong", msg[1]]))

    sock.send(msgspec.msgpack.encode(["ready"]))
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is sock:
                    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
                    if not data:
                        return  # the launcher closed its end, or died
                    on_request(msgspec.msgpack.decode(data), fds)
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    _reap(sock, children)
    finally:
        sel.close()


def _reap(sock: socket.socket, children: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for rid in [r for r, p in children.items() if p == pid]:
            del children[rid]
        with contextlib.suppress(OSError):
            sock.send(msgspec.msgpack.encode(["exit", pid, os.waitstatus_to_exitcode(status)]))


def _readable(fd: int) -> bool:
    sel = selectors.DefaultSelector()
    try:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(0))
    finally:
        sel.close()
