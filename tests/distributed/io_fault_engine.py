"""The real engine process (``tidal.engine_core.entry``) with test-only faults, for
test_io_thread_faults.py and test_frozen_ranks.py (run as ``python -m io_fault_engine``):

- utility ``unencodable``: returns a value msgspec cannot encode;
- utility ``unencodable_output``: queues a request output batch that cannot be encoded
  (its requests must fail, not hang);
- utility ``break_output_thread``: queues an item the output thread fails on (a
  destination with no socket), as a bug there would;
- a client frame whose type byte is ``BREAK_INPUT`` makes the input thread fail outside
  its per-frame handling (a ``BaseException`` from the decoder), as a bug there would;
- utility ``stall``: the busy loop sleeps inside its iteration for good, while its I/O
  threads go on (heartbeats flow): a GPU hang or a deadlock, for the stall watchdog.
"""

from __future__ import annotations

import time
from typing import Any

from tidal.engine_core import proc as engine_proc
from tidal.engine_core.entry import main
from tidal.engine_core.proc import EngineCoreProc
from tidal.protocol.messages import EngineCoreOutput, EngineCoreOutputs

BREAK_INPUT = b"\xfe"


class InjectedCrash(BaseException):
    """Not an ``Exception``: it escapes the input thread's per-frame handling."""


def _unencodable(self: EngineCoreProc) -> Any:
    return {"fine": 1, "not": object()}


def _unencodable_output(self: EngineCoreProc, request_id: str) -> bool:
    bad = EngineCoreOutput(request_id, [object()])  # type: ignore[list-item]
    self._send_outputs(EngineCoreOutputs(outputs=[bad]))
    return True


def _stall(self: EngineCoreProc) -> bool:
    while True:  # inside a busy-loop iteration (the utility runs there), never done
        time.sleep(3600)


def _break_output_thread(self: EngineCoreProc) -> bool:
    self.output_queue.put_nowait((99, b"no socket for this destination"))
    return True


_decode = engine_proc.decode_client_request


def _decode_or_crash(kind: bytes, payload: Any) -> Any:
    if kind == BREAK_INPUT:
        raise InjectedCrash("injected input thread failure")
    return _decode(kind, payload)


def install_faults() -> None:
    """Only in the engine process (importing this module changes nothing)."""
    EngineCoreProc.utility_unencodable = _unencodable  # type: ignore[attr-defined]
    EngineCoreProc.utility_unencodable_output = _unencodable_output  # type: ignore[attr-defined]
    EngineCoreProc.utility_break_output_thread = _break_output_thread  # type: ignore[attr-defined]
    EngineCoreProc.utility_stall = _stall  # type: ignore[attr-defined]
    engine_proc.decode_client_request = _decode_or_crash


if __name__ == "__main__":
    install_faults()
    main()
