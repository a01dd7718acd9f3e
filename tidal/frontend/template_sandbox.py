"""Request-supplied chat templates, rendered in a child process that can be killed.

A chat template is a program. transformers renders it in jinja2's
``ImmutableSandboxedEnvironment``, which keeps it away from Python internals but not from
running for ever (nested loops, recursion), computing ``10 ** 10 ** 9`` (jinja folds it
while compiling) or building a gigabyte string; a thread stuck in one such C call cannot be
stopped. So templates that come with a request (accepted only with
``--trust-request-chat-template``) render in a worker process: one render at a time, each
with a deadline. Past the deadline, or if the worker dies, it is killed (the next render
starts a fresh one) and the request gets a 400. The worker also caps its own memory
(``RLIMIT_DATA``) and volunteers for the OOM killer, so a template cannot push the engines
out of memory.

The worker loads the same tokenizer, so the template sees the same special tokens and
transformers' own rendering (its sandbox, control-token sanitising); it returns the text and
its token ids. Frames on its stdin/stdout are a 4-byte big-endian length + msgpack (never
pickle). It runs as ``python -P -m tidal.frontend.template_sandbox TOKENIZER``, so it never
re-imports the caller's ``__main__`` and imports nothing from the server's working
directory (``worker_command``, ``worker_env``: the template is hostile, and so may be
the directory), and it exits when its stdin closes (the server went).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO

import msgspec

from tidal.utils.secret_env import without_secrets

# Generous for any real template (they render in milliseconds); a template still running
# after this is treated as hostile.
RENDER_TIMEOUT_S = 10.0
# Loading a tokenizer on a busy host; only the first render after a (re)start waits for it.
STARTUP_TIMEOUT_S = 120.0
# Headroom over the worker's size once its tokenizer is loaded.
WORKER_MEMORY_HEADROOM_BYTES = 1 << 30

_MODULE = "tidal.frontend.template_sandbox"  # ``__name__`` is "__main__" in the worker
_LEN = struct.Struct(">I")
_MAX_ERROR_CHARS = 2000


class RenderRequest(msgspec.Struct, array_like=True):
    messages: list[dict[str, Any]]
    chat_template: str
    add_generation_prompt: bool
    kwargs: dict[str, Any]  # template inputs (chat_template_kwargs), continue_final_message
    max_chars: int  # a longer rendering is refused


class RenderReply(msgspec.Struct, array_like=True):
    text: str = ""
    token_ids: list[int] = []
    error: str | None = None


_ENCODER = msgspec.msgpack.Encoder()


class SandboxUnavailable(RuntimeError):
    """The worker could not be started: the server's fault, not the template's."""


class TemplateSandbox:
    """Renders request-supplied chat templates in a killable worker (see the module doc).

    Belongs to the event loop that first calls ``render``; ``close()`` stops the worker."""

    def __init__(
        self,
        tokenizer: str,
        *,
        max_chars: int,
        timeout_s: float = RENDER_TIMEOUT_S,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._reaping: set[asyncio.Future] = set()
        self.workers_killed = 0  # timeouts, deaths, cancellations

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def render(
        self,
        messages: list[dict[str, Any]],
        *,
        chat_template: str,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids; ValueError (a 400) when the template
        fails, runs past the deadline or kills its worker."""
        frame = _ENCODER.encode(
            RenderRequest(messages, chat_template, add_generation_prompt, kwargs, self.max_chars)
        )
        async with self._lock:
            proc = await self._started()
            try:
                reply = await asyncio.wait_for(self._exchange(proc, frame), self.timeout_s)
            except TimeoutError:
                self._kill()
                raise ValueError(
                    f"chat_template: rendering took longer than {self.timeout_s:g} s; refused"
                ) from None
            except (asyncio.IncompleteReadError, ConnectionError):
                self._kill()
                raise ValueError(
                    "chat_template: the template renderer died (out of memory?); refused"
                ) from None
            except BaseException:
                # Cancelled (the client went away): its reply would be read as the next
                # render's, so this worker cannot be reused.
                self._kill()
                raise
        if reply.error is not None:
            raise ValueError(f"chat_template: {reply.error}")
        return reply.text, reply.token_ids

    async def close(self) -> None:
        """Stop the worker: EOF on its stdin, then kill if it does not exit promptly."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(Exception):
                _stdio(proc)[0].close()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)

    # ---- internals -------------------------------------------------------------------

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        self._proc = await asyncio.create_subprocess_exec(
            *worker_command(self.tokenizer),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=worker_env(os.environ),
        )
        try:
            ready = await asyncio.wait_for(_read_reply(self._proc), self.startup_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError) as e:
            self._kill()
            raise SandboxUnavailable(f"the chat template renderer did not start: {e!r}") from None
        except BaseException:
            self._kill()
            raise
        if ready.error is not None:
            self._kill()
            raise SandboxUnavailable(f"the chat template renderer did not start: {ready.error}")
        return self._proc

    async def _exchange(self, proc: asyncio.subprocess.Process, frame: bytes) -> RenderReply:
        stdin = _stdio(proc)[0]
        stdin.write(_LEN.pack(len(frame)) + frame)
        await stdin.drain()
        return await _read_reply(proc)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.workers_killed += 1
        if proc.returncode is None:
            proc.kill()
        # Reap it (and close its pipes) in the background; close() waits for these.
        fut = asyncio.ensure_future(proc.wait())
        self._reaping.add(fut)
        fut.add_done_callback(self._reaping.discard)


def worker_command(tokenizer: str) -> list[str]:
    """``python -P -m ...``: ``-P`` (safe path) keeps the working directory off
    ``sys.path``, so a module there cannot shadow one the worker imports."""
    return [sys.executable, "-P", "-m", _MODULE, tokenizer]


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: the server's less its secrets (it runs templates that
    clients wrote), with ``PYTHONPATH`` cleaned of what names the working directory
    without saying so (empty and relative entries, which ``-P`` does not drop: Python
    reads them against the working directory)."""
    env = without_secrets(environ)
    entries = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    return env


def _stdio(proc: asyncio.subprocess.Process) -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
    """The worker's stdin and stdout (it is always started with both piped)."""
    if proc.stdin is None or proc.stdout is None:
        raise SandboxUnavailable("the chat template renderer was started without pipes")
    return proc.stdin, proc.stdout


async def _read_reply(proc: asyncio.subprocess.Process) -> RenderReply:
    stdout = _stdio(proc)[1]
    (n,) = _LEN.unpack(await stdout.readexactly(_LEN.size))
    return msgspec.msgpack.decode(await stdout.readexactly(n), type=RenderReply)


# ---- the worker ------------------------------------------------------------------------


def _serve(tokenizer_path: str) -> int:
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    try:
        from transformers import AutoTokenizer  # only the worker renders

        tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses the request
        _send(out, RenderReply(error=f"cannot load the tokenizer: {e}"[:_MAX_ERROR_CHARS]))
        return 1
    _limit_memory(WORKER_MEMORY_HEADROOM_BYTES)
    _send(out, RenderReply(text="ready"))
    decoder = msgspec.msgpack.Decoder(RenderRequest)
    while (frame := _recv(inp)) is not None:
        _send(out, _render(tok, decoder.decode(frame)))
    return 0


def _render(tok: Any, req: RenderRequest) -> RenderReply:
    try:
        text = tok.apply_chat_template(
            req.messages,
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
            chat_template=req.chat_template,
            **req.kwargs,
        )
        if not isinstance(text, str):
            raise ValueError("the template did not render to text")
        if len(text) > req.max_chars:
            raise ValueError(f"the rendered prompt is longer than {req.max_chars} characters")
        return RenderReply(text=text, token_ids=tok.encode(text, add_special_tokens=False))
    except Exception as e:  # noqa: BLE001 - MemoryError and RecursionError included
        return RenderReply(error=f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS])


def _recv(inp: BinaryIO) -> bytes | None:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None  # the parent closed our stdin (or went away)
    (n,) = _LEN.unpack(head)
    return inp.read(n)


def _send(out: BinaryIO, reply: RenderReply) -> None:
    frame = _ENCODER.encode(reply)
    out.write(_LEN.pack(len(frame)) + frame)
    out.flush()


def _limit_memory(headroom: int) -> None:
    """Best effort (Linux): cap the heap at its current size + ``headroom`` so a template
    that builds a huge value gets MemoryError, and be the OOM killer's first choice."""
    with contextlib.suppress(OSError):
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    try:
        import resource

        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        soft = kib * 1024 + headroom
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    except (ImportError, OSError, ValueError, StopIteration):
        pass


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
