"""Processes a selected test needs that may start with the session: they run at the lowest
CPU priority in the time the other tests leave idle (a whole run keeps 2 cores about two
thirds busy), and the test collects their results when it runs.

A test declares its start with ``@started_with_the_session(make)``; ``tests/conftest.py``
starts the jobs of the selected tests once collection ends and stops what is left at the
end of the session. A test whose job the session did not start (run without the hook)
starts it itself, and waits for it as it would for its own work.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

import pytest

_NICEST = "19"


@dataclass
class Job:
    """Named commands, each in a process group of its own (a compiler driver's children
    are stopped with it) at nice 19 from its first instruction (``nice``, where the machine
    has it: renicing after the start would miss the children forked first), each with its
    output in a temp file (a pipe nobody reads before the test runs would fill and block)."""

    commands: dict[str, Sequence[str]]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict, init=False)
    _outputs: dict[str, IO[bytes]] = field(default_factory=dict, init=False)

    def start(self) -> Job:
        nice = shutil.which("nice")
        try:
            for name, argv in self.commands.items():
                out = tempfile.TemporaryFile()
                self._outputs[name] = out
                prefix = [nice, "-n", _NICEST] if nice else []
                self.procs[name] = subprocess.Popen(
                    [*prefix, *argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        except BaseException:
            self.stop()
            raise
        return self

    def results(self, timeout_s: float) -> dict[str, tuple[int, str]]:
        """Each command's exit status and output (its last 3,000 characters), once all
        ended; ``timeout_s`` bounds the whole wait."""
        deadline = time.monotonic() + timeout_s
        results = {}
        for name, proc in self.procs.items():
            # The test waits here: nothing else runs, so niced or not they get the cores.
            rc = proc.wait(max(0.0, deadline - time.monotonic()))
            out = self._outputs[name]
            out.seek(0)
            results[name] = (rc, out.read().decode(errors="replace")[-3000:])
        return results

    def stop(self) -> None:
        """SIGTERM to each group (a compiler driver removes its temp files), then SIGKILL
        to what is left of it."""
        for proc in self.procs.values():
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)  # the group's stragglers too
            proc.wait()
        for out in self._outputs.values():
            out.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone


_JOBS = pytest.StashKey[dict[str, Job | None]]()
_START_ATTR = "_started_with_the_session"


def started_with_the_session(make: Callable[[], Job | None]) -> Callable:
    """Mark a test whose ``make()`` job (None: nothing to start here) starts with the
    session; the test gets it from ``job_of(request)``."""

    def mark(test: Callable) -> Callable:
        setattr(test, _START_ATTR, make)
        return test

    return mark


def start_selected(session: pytest.Session) -> None:
    jobs: dict[str, Job | None] = {}
    session.config.stash[_JOBS] = jobs
    # Nothing will run: a collection that failed, or one that only lists the tests.
    if session.config.option.collectonly or session.testsfailed:
        return
    for item in session.items:
        make = getattr(getattr(item, "function", None), _START_ATTR, None)
        if make is not None:
            try:
                job = make()
                jobs[item.nodeid] = job.start() if job is not None else None
            except Exception:  # noqa: BLE001 - not stored: the test starts it and reports
                continue


def job_of(request: pytest.FixtureRequest) -> Job | None:
    """This test's job: the one started with the session, else started now. None only
    where ``make()`` had nothing to start."""
    jobs = request.config.stash.get(_JOBS, {})
    if request.node.nodeid in jobs:
        return jobs[request.node.nodeid]
    job = getattr(request.function, _START_ATTR)()
    if job is not None:
        jobs[request.node.nodeid] = job.start()
        request.config.stash[_JOBS] = jobs
    return job


def stop_all(config: pytest.Config) -> None:
    for job in config.stash.get(_JOBS, {}).values():
        if job is not None:
            job.stop()
