"""Counting what an I/O loop had to drop (a frame that does not decode, a message that
cannot be encoded or handled), so a bad frame costs one message, never the thread.

Every drop is counted by kind and logged; the log is rate-limited per kind (the first
drop of a kind at once, then at most one line per ``log_interval_s`` with how many were
dropped since), so a peer that floods garbage cannot flood the log too.
"""

from __future__ import annotations

import logging
import threading
import time


class DropCounter:
    """Drops of one process's I/O loops, by kind. Thread-safe."""

    def __init__(self, owner: str, logger: logging.Logger, log_interval_s: float = 5.0) -> None:
        self.owner = owner
        self._logger = logger
        self._log_interval_s = log_interval_s
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def drop(self, kind: str, error: BaseException | str, *, exc_info: bool = False) -> None:
        """Count one dropped ``kind`` (e.g. ``"client request"``) and log why."""
        now = time.monotonic()
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            last = self._last_log.get(kind)
            if last is not None and now - last < self._log_interval_s:
                self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
                return
            self._last_log[kind] = now
            skipped = self._unlogged.pop(kind, 0)
            total = self._counts[kind]
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        more = f" ({skipped} more dropped unlogged)" if skipped else ""
        self._logger.error(
            "%s: dropped a %s (%d so far)%s: %s",
            self.owner,
            kind,
            total,
            more,
            why,
            exc_info=error if exc_info and isinstance(error, BaseException) else None,
        )

    def counts(self) -> dict[str, int]:
        """Drops so far, by kind."""
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
