"""Child Python processes that never re-import the caller's ``__main__``.

multiprocessing's ``spawn`` start method runs the parent's main module again in every
child (as ``__mp_main__``): a user script written without an
``if __name__ == "__main__":`` guard would start itself over in each engine process. A
``ModuleProcess`` runs ``python -P -m <module> <name>`` instead, so the child imports that
module and what it imports, nothing else. Its launch arguments travel as bytes on the
child's stdin (msgspec, never pickle), which also keeps them out of ``ps``.

The launcher owns its children's lifetime. Each child runs in its own process group, so
a terminal's Ctrl-C (SIGINT to the foreground group) reaches only the launcher, which then
stops the children in order (SIGTERM, then SIGKILL after a deadline): a half-started
child never prints a KeyboardInterrupt traceback, and data-parallel ranks are not torn
down independently mid-wave. A child whose launcher dies without stopping it (SIGKILL)
must notice on its own (``ProcessWatch`` on the launcher's pid) and exit. The launcher is
the process that asked for the child, which need not be its parent: a warm launcher
(``tidal.utils.forkserver``) forks children on another process's behalf, and their
parent dying says nothing about their launcher.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import select
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from tidal.utils.proctitle import set_process_name
from tidal.utils.secret_env import without_secrets


@functools.cache
def _pidfd_supported() -> bool:
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:  # old kernel or a seccomp filter
        return False
    os.close(fd)
    return True


class ProcessWatch:
    """Whether process ``pid`` (a child's launcher) has exited, polled from any thread.

    A pidfd where the kernel has them (readable once the process exited; immune to pid
    reuse), else the parent pid for a launcher that is our parent (it changes when the
    parent dies), else ``kill(pid, 0)``. Race: the pidfd is opened when the watch is made;
    a launcher that died and whose pid was reused before that would be mistaken for the
    new process. Watches are made at the child's start, moments after the launcher asked
    for it, so that would take a pid wrap-around within moments."""

    def __init__(self, pid: int | None = None) -> None:
        self._parent = os.getppid()
        self.pid = self._parent if pid is None else pid
        self._fd: int | None = None
        if _pidfd_supported():
            try:
                self._fd = os.pidfd_open(self.pid)
            except ProcessLookupError:
                self._gone = True
                return
        self._gone = False

    @property
    def fileno(self) -> int | None:
        """The pidfd (readable once the process exited), for a poller; None without."""
        return self._fd

    def gone(self) -> bool:
        if self._gone:
            return True
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], 0)[0])
        elif self.pid == self._parent:
            self._gone = os.getppid() != self._parent
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
            except PermissionError:
                pass  # exists (another user's pid: reused, but we cannot tell)
        return self._gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The parent's environment (less its secrets: ``secret_env``) plus ``extra``, with its
    ``sys.path`` as the child's ``PYTHONPATH``.

    The child then imports exactly what the parent would (a source checkout, a path added
    by a test runner) — what multiprocessing's spawn gets by copying ``sys.path`` — while
    ``-P`` keeps the child's working directory off its path."""
    env = {**without_secrets(os.environ), **(extra or {})}
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if os.path.exists(p)))
    return env


class ModuleProcess:
    """``python -m module`` as a child, with the part of ``multiprocessing.Process``'s
    interface that process managers use: ``name``, ``pid``, ``sentinel``, ``is_alive()``,
    ``exitcode`` (negative signal number when killed by one), ``terminate()``, ``kill()``,
    ``join(timeout)``; ``close()`` releases the sentinel once the process is done with.

    ``payload`` is written to the child's stdin, which is then closed: the child reads it
    to EOF (``read_child_launch``). ``pass_fds`` stay open in the child (e.g. a pipe end
    for a startup reply); ``env`` adds to (or overrides) the inherited environment."""

    def __init__(
        self,
        module: str,
        name: str,
        payload: bytes = b"",
        *,
        pass_fds: Sequence[int] = (),
        env: Mapping[str, str] | None = None,  # added to the inherited environment
    ) -> None:
        self.name = name
        self.module = module
        fds = list(pass_fds)
        watch_r = watch_w = -1
        if not _pidfd_supported():
            # The child holds the write end until it exits; the read end then hits EOF,
            # which is what makes it usable with multiprocessing.connection.wait.
            watch_r, watch_w = os.pipe()
            fds.append(watch_w)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-P", "-m", module, name],
                stdin=subprocess.PIPE,
                pass_fds=fds,
                env=_child_env(env),
                process_group=0,  # see the module docstring: Ctrl-C reaches the launcher only
            )
        except BaseException:
            if watch_r >= 0:
                os.close(watch_r)
                os.close(watch_w)
            raise
        if watch_w >= 0:
            os.close(watch_w)
        self.pid: int = self._popen.pid
        self.sentinel: int = os.pidfd_open(self.pid) if watch_r < 0 else watch_r
        self._closed = False
        self._send_payload(payload)

    def _send_payload(self, payload: bytes) -> None:
        stdin = self._popen.stdin
        assert stdin is not None
        # A child that already died makes these raise: its exitcode and sentinel say so.
        with contextlib.suppress(BrokenPipeError):
            stdin.write(payload)
        with contextlib.suppress(BrokenPipeError):
            stdin.close()  # flushes, then closes even if the flush fails

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def terminate(self) -> None:
        self._popen.terminate()  # a no-op once reaped; ProcessLookupError is handled

    def kill(self) -> None:
        self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # like Process.join: the caller checks is_alive()

    def close(self) -> None:
        """Release the sentinel; reaps the process if it has exited. Idempotent."""
        if not self._closed:
            self._closed = True
            self._popen.poll()
            os.close(self.sentinel)

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else f"exitcode={self.exitcode}"
        return f"<ModuleProcess {self.name} pid={self.pid} {state}>"


def kill_if_named(pid: int, prefix: str) -> bool:
    """SIGKILL ``pid`` if it is still a process whose name (``set_process_name``'s, at
    most 15 characters) starts with ``prefix``: a pid reused by another program is left
    alone. True if it was killed."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
    except OSError:
        return False
    if not name.startswith(prefix[:15]):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


def read_child_launch() -> tuple[str, bytes]:
    """In a ``ModuleProcess`` child: name this process (``ps``/psutil ``name()``, and
    multiprocessing's process name, which logging shows) and return ``(name, payload)``."""
    name = sys.argv[1] if len(sys.argv) > 1 else os.path.basename(sys.argv[0])
    set_process_name(name)
    multiprocessing.current_process().name = name
    return name, sys.stdin.buffer.read()
