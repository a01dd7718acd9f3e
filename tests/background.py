"""Processes a selected test needs that may start with the session: they run at the lowest
CPU priority in the time the other tests leave idle (a whole run keeps 2 cores about two
thirds busy), and the test collects their results when it runs.

A test declares its start with ``@started_with_the_session(start)``; ``tests/conftest.py``
starts the jobs of the selected tests once collection ends and kills what is left at the
end of the session. Run alone, a test waits for its job as it would for its own work.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

import pytest

_NICEST = 19


@dataclass
class Job:
    """Named commands, started niced, each with its output in a temp file (a pipe nobody
    reads while the test has not run would fill and block them)."""

    commands: dict[str, Sequence[str]]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _outputs: dict[str, IO[bytes]] = field(default_factory=dict)

    def start(self) -> Job:
        for name, argv in self.commands.items():
            out = tempfile.TemporaryFile()
            self._outputs[name] = out
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT)
            self.procs[name] = proc
            try:
                os.setpriority(os.PRIO_PROCESS, proc.pid, _NICEST)
            except ProcessLookupError:
                pass  # done already
        return self

    def results(self, timeout_s: float) -> dict[str, tuple[int, str]]:
        """Each command's exit status and output (its last 3,000 characters), once all ended."""
        results = {}
        for name, proc in self.procs.items():
            rc = proc.wait(timeout_s)  # the machine is ours now: they run at full speed
            out = self._outputs[name]
            out.seek(0)
            results[name] = (rc, out.read().decode(errors="replace")[-3000:])
        return results

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for out in self._outputs.values():
            out.close()


_JOBS = pytest.StashKey[dict[str, Job]]()
_START_ATTR = "_started_with_the_session"


def started_with_the_session(make: Callable[[], Job | None]) -> Callable:
    """Mark a test whose ``make()`` job (None: nothing to start) starts with the session;
    the test gets it from ``job_of(request)``."""

    def mark(test: Callable) -> Callable:
        setattr(test, _START_ATTR, make)
        return test

    return mark


def start_selected(session: pytest.Session) -> None:
    jobs: dict[str, Job] = {}
    session.config.stash[_JOBS] = jobs
    if session.config.option.collectonly:
        return
    for item in session.items:
        make = getattr(getattr(item, "function", None), _START_ATTR, None)
        if make is not None:
            job = make()
            if job is not None:
                jobs[item.nodeid] = job.start()


def job_of(request: pytest.FixtureRequest) -> Job | None:
    """This test's job, started with the session (None where ``make()`` gave none)."""
    return request.config.stash.get(_JOBS, {}).get(request.node.nodeid)


def stop_all(config: pytest.Config) -> None:
    for job in config.stash.get(_JOBS, {}).values():
        job.stop()
