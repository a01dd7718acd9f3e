"""The offline API as people write scripts: each test saves a script and runs it with
``python script.py``, as a user would, then checks that it printed its output, exited,
and left no process behind.

Every process a script starts carries a tag in its environment (children inherit it),
so the test finds them all by scanning ``psutil``, orphans included, while the script runs
and after it exits. Whatever is still alive at the end is killed, so a failing test
leaves nothing behind either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tidal.engine_core.entry import ENGINE_ENTRY_MODULE
from tidal.executor.worker_proc import WORKER_ENTRY_MODULE

pytestmark = pytest.mark.timeout(600)

# Deadlines, not expectations: starting engines costs several seconds on a small machine.
SCRIPT_DEADLINE_S = 180.0
STOP_DEADLINE_S = 60.0
_TAG = "TIDAL_TEST_SCRIPT_TAG"


@pytest.fixture(scope="module", autouse=True)
def default_model() -> str:
    """Build the embedded default model once, before any script races to build it."""
    # Imported here, not at the top: see tests/conftest.py (model classes pull in triton).
    from tidal.models.tiny import default_model_path

    return default_model_path()


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(_TAG) == tag:
                found.append(p)
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or another user's process
    return found


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def _sigint_not_ignored():
    """The script starts with SIGINT at its default, as from a terminal. A test run
    started as a background job (``cmd &`` in a non-interactive shell) ignores SIGINT, an
    ignored signal stays ignored across exec, and Python then installs no
    KeyboardInterrupt handler: Ctrl-C would do nothing. A handler (unlike SIG_IGN) is
    reset to the default by exec."""
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before is signal.SIG_IGN:
            signal.signal(signal.SIGINT, before)


class Script:
    """``python script.py`` in ``tmp_path``, in its own session (as a shell job would be:
    its own process group, which a terminal's Ctrl-C signals as a whole)."""

    def __init__(self, tmp_path: Path, source: str) -> None:
        path = tmp_path / "script.py"
        path.write_text(textwrap.dedent(source))
        self.tag = uuid.uuid4().hex
        with _sigint_not_ignored():
            self.proc = subprocess.Popen(
                [sys.executable, str(path)],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, _TAG: self.tag, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        # pid -> command line of every tagged process seen (its name changes as it starts)
        self.seen: dict[int, str] = {}
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._line = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._line:
                lines.append(line)
                self._line.notify_all()
        with self._line:
            self._line.notify_all()

    def scan(self) -> None:
        for p in _tagged(self.tag):
            if p.pid != self.proc.pid and p.pid not in self.seen:
                try:
                    self.seen[p.pid] = " ".join(p.cmdline())
                except psutil.Error:
                    pass

    def engines_seen(self) -> int:
        return sum(ENGINE_ENTRY_MODULE in cmd for cmd in self.seen.values())

    def wait_for_line(self, text: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        with self._line:
            while not any(text in line for line in self.stdout):
                assert self.proc.poll() is None, f"script exited before {text!r}:\n{self.output}"
                assert time.monotonic() < deadline, f"no {text!r} in {deadline_s} s:\n{self.output}"
                self._line.wait(0.5)

    def wait(self, deadline_s: float) -> int:
        """Wait for the script to exit, recording the processes it starts meanwhile."""
        deadline = time.monotonic() + deadline_s
        while self.proc.poll() is None:
            self.scan()
            if time.monotonic() > deadline:
                raise AssertionError(f"script still running after {deadline_s} s:\n{self.output}")
            try:
                self.proc.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
        for t in self._readers:
            t.join(10)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "--- stdout\n" + "".join(self.stdout) + "--- stderr\n" + "".join(self.stderr)

    def leftovers(self) -> list[psutil.Process]:
        """Tagged processes still alive: none may be, the moment the script has exited."""
        return [p for p in _tagged(self.tag) if _alive(p)]

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for p in _tagged(self.tag):
            try:
                p.kill()
            except psutil.Error:
                pass
        for t in self._readers:  # EOF now that every writer is gone
            t.join(10)
        for s in (self.proc.stdout, self.proc.stderr):
            s.close()


@pytest.fixture
def run_script(tmp_path: Path):
    started: list[Script] = []

    def run(source: str) -> Script:
        script = Script(tmp_path, source)
        started.append(script)
        return script

    yield run
    for s in started:
        s.kill_all()


def _check_clean_exit(script: Script, rc: int) -> None:
    assert rc == 0, script.output
    assert "Traceback" not in "".join(script.stderr), script.output
    assert script.leftovers() == [], f"processes left behind:\n{script.output}"
    # The engines really were separate processes (and the script ran only once).
    assert script.engines_seen() > 0, script.seen


def test_plain_script_without_guard_or_shutdown(run_script) -> None:
    script = run_script(
        """
        from tidal import LLM, SamplingParams
        llm = LLM(multiprocess=True)
        out = llm.generate(["The tide comes in"], SamplingParams(temperature=0, max_tokens=8))
        print("OUTPUT:", repr(out[0].outputs[0].text))
        """
    )
    _check_clean_exit(script, script.wait(SCRIPT_DEADLINE_S))
    outputs = [line for line in script.stdout if line.startswith("OUTPUT:")]
    assert len(outputs) == 1, script.output  # a child that re-ran the script would print too


def test_plain_script_with_tensor_parallel_workers(run_script) -> None:
    """``LLM(tensor_parallel_size=2)`` in a script without guard or shutdown: the engine
    core runs in the script, its two workers start as ``python -m
    tidal.executor.worker_proc`` (the script runs once), and all stop when it ends."""
    script = run_script(
        """
        from tidal import LLM, SamplingParams
        llm = LLM(tensor_parallel_size=2)
        out = llm.generate(["The tide comes in"], SamplingParams(temperature=0, max_tokens=8))
        print("OUTPUT:", repr(out[0].outputs[0].text))
        """
    )
    rc = script.wait(SCRIPT_DEADLINE_S)
    assert rc == 0 and "Traceback" not in "".join(script.stderr), script.output
    assert script.leftovers() == [], f"processes left behind:\n{script.output}"
    workers = [c for c in script.seen.values() if WORKER_ENTRY_MODULE in c]
    assert len(workers) == 2, script.seen
    outputs = [line for line in script.stdout if line.startswith("OUTPUT:")]
    assert len(outputs) == 1, script.output


def test_default_llm_runs_its_engine_in_the_script(run_script) -> None:
    """One CPU rank: the engine core runs in the script's own process (``runs_in_process``),
    so a plain script starts no child process at all, and still ends cleanly."""
    script = run_script(
        """
        import psutil
        from tidal import LLM, SamplingParams
        llm = LLM()
        out = llm.generate(["The tide comes in"], SamplingParams(temperature=0, max_tokens=8))
        print("OUTPUT:", repr(out[0].outputs[0].text))
        print("CHILDREN:", psutil.Process().children())
        """
    )
    rc = script.wait(SCRIPT_DEADLINE_S)
    assert rc == 0 and "Traceback" not in "".join(script.stderr), script.output
    text = "".join(script.stdout)
    assert "CHILDREN: []" in text and text.count("OUTPUT:") == 1, script.output
    assert script.engines_seen() == 0 and script.leftovers() == [], script.output


def test_guarded_script(run_script) -> None:
    script = run_script(
        """
        from tidal import LLM, SamplingParams

        def main():
            llm = LLM(multiprocess=True)
            out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
            print("OUTPUT:", repr(out[0].outputs[0].text))

        if __name__ == "__main__":
            main()
        """
    )
    _check_clean_exit(script, script.wait(SCRIPT_DEADLINE_S))
    assert sum(line.startswith("OUTPUT:") for line in script.stdout) == 1, script.output


def test_with_block_data_parallel(run_script) -> None:
    """``with LLM(...)`` closes the engines at the end of the block, DP ranks and the DP
    coordinator included; outputs match a second, plain generate in the same script."""
    script = run_script(
        """
        import psutil
        from tidal import LLM, SamplingParams

        params = SamplingParams(temperature=0, max_tokens=8)
        prompts = ["The tide comes in", "Mixture of experts", "Hello", "Waves"]
        with LLM(data_parallel_size=2) as llm:
            outs = llm.generate(prompts, params)
            print("CHILDREN IN BLOCK:", sorted(c.name() for c in psutil.Process().children()))
        print("CHILDREN AFTER BLOCK:", psutil.Process().children())
        try:
            llm.generate(prompts, params)
        except RuntimeError as e:
            print("AFTER BLOCK:", e)
        for o in outs:
            print("OUTPUT:", repr(o.outputs[0].text))
        """
    )
    _check_clean_exit(script, script.wait(SCRIPT_DEADLINE_S))
    text = "".join(script.stdout)
    assert "CHILDREN IN BLOCK: ['DPCoordinator', 'EngineCore_DP0', 'EngineCore_DP1']" in text, (
        script.output
    )
    assert "CHILDREN AFTER BLOCK: []" in text, script.output
    assert "AFTER BLOCK: this LLM was shut down" in text, script.output
    assert sum(line.startswith("OUTPUT:") for line in script.stdout) == 4, script.output


def test_del_llm_stops_engines_and_script_continues(run_script) -> None:
    script = run_script(
        """
        import psutil
        from tidal import LLM, SamplingParams

        llm = LLM(multiprocess=True)
        out = llm.generate(["The tide comes in"], SamplingParams(temperature=0, max_tokens=8))
        print("OUTPUT:", repr(out[0].outputs[0].text))
        print("CHILDREN BEFORE DEL:", [c.name() for c in psutil.Process().children()])
        del llm, out
        print("CHILDREN AFTER DEL:", psutil.Process().children())
        print("STILL RUNNING")
        """
    )
    _check_clean_exit(script, script.wait(SCRIPT_DEADLINE_S))
    text = "".join(script.stdout)
    assert "CHILDREN BEFORE DEL: ['EngineCore_DP0']" in text, script.output
    # Collected at once (no reference cycle keeps it), engines reaped before the next line.
    assert "CHILDREN AFTER DEL: []" in text, script.output
    assert "STILL RUNNING" in text, script.output


def test_ctrl_c_during_generate_stops_everything(run_script) -> None:
    script = run_script(
        """
        from tidal import LLM, SamplingParams

        llm = LLM(multiprocess=True)
        llm.generate(["warm up"], SamplingParams(max_tokens=2))
        print("GENERATING", flush=True)
        llm.generate(["x"] * 64, SamplingParams(max_tokens=1500, ignore_eos=True))
        print("FINISHED")
        """
    )
    script.wait_for_line("GENERATING", SCRIPT_DEADLINE_S)
    script.scan()
    os.killpg(script.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    rc = script.wait(STOP_DEADLINE_S)
    stderr = "".join(script.stderr)
    # Python re-raises an uncaught KeyboardInterrupt as death by SIGINT.
    assert rc in (-signal.SIGINT, 128 + signal.SIGINT), script.output
    assert "FINISHED" not in "".join(script.stdout), script.output
    # The script's own KeyboardInterrupt and nothing from the engines.
    assert stderr.count("Traceback") == 1 and "KeyboardInterrupt" in stderr, script.output
    assert script.leftovers() == [], f"processes left behind:\n{script.output}"
    assert script.engines_seen() > 0, script.seen


def test_killed_script_leaves_no_engine(run_script) -> None:
    """SIGKILL gives the script no chance to clean up: the engines notice that their
    launcher is gone and exit on their own, without waiting to drain."""
    script = run_script(
        """
        from tidal import LLM, SamplingParams

        llm = LLM(multiprocess=True)
        llm.generate(["warm up"], SamplingParams(max_tokens=2))
        print("GENERATING", flush=True)
        llm.generate(["x"] * 64, SamplingParams(max_tokens=1500, ignore_eos=True))
        """
    )
    script.wait_for_line("GENERATING", SCRIPT_DEADLINE_S)
    script.scan()
    os.kill(script.proc.pid, signal.SIGKILL)
    assert script.wait(STOP_DEADLINE_S) == -signal.SIGKILL
    assert script.engines_seen() > 0, script.seen
    deadline = time.monotonic() + STOP_DEADLINE_S
    while left := script.leftovers():
        assert time.monotonic() < deadline, f"orphaned engines {left} still alive:\n{script.output}"
        psutil.wait_procs(left, timeout=1)


def test_engine_client_dropped_or_never_shut_down(run_script) -> None:
    """The engine client benchmarks and tests use directly: dropping it stops its engines,
    and one never shut down does not keep the script from exiting."""
    script = run_script(
        """
        import psutil
        from tidal.launch.engine_args import EngineArgs
        from tidal.frontend.loop_client import LoopThreadClient

        config = EngineArgs().create_engine_config()
        client = LoopThreadClient(config)
        print("CHILDREN:", [c.name() for c in psutil.Process().children()])
        del client
        print("AFTER DEL:", psutil.Process().children())
        kept = LoopThreadClient(config)
        print("KEPT:", [c.name() for c in psutil.Process().children()])
        """
    )
    _check_clean_exit(script, script.wait(SCRIPT_DEADLINE_S))
    text = "".join(script.stdout)
    assert "CHILDREN: ['EngineCore_DP0']" in text, script.output
    assert "AFTER DEL: []" in text, script.output
    assert "KEPT: ['EngineCore_DP0']" in text, script.output
