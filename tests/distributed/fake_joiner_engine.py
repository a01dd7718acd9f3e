"""A stand-in engine for test_elastic_proc_manager.py (run as ``python -m fake_joiner_engine``):
only the startup handshake of a joining engine, then it waits for a signal.

Its behaviour comes from ``FAKE_JOINER_MODES`` (``"<engine id>:<mode>,..."``; default
``ready``): ``ready`` (READY, or READY(error) unless the answer carried ``joining`` and a
topology holding this engine), ``error`` (READY(error)), ``exit`` (exit 3 before READY)."""

from __future__ import annotations

import os
import signal
import sys

import msgspec
import zmq

from tidal.protocol.messages import EngineAddresses, EngineHello, EngineReady, encode
from tidal.utils.procs import read_child_launch

if __name__ == "__main__":
    _, payload = read_child_launch()
    launch = msgspec.msgpack.decode(payload)
    engine_id, address = launch["engine_id"], launch["handshake_address"]
    modes = dict(
        item.split(":") for item in os.environ.get("FAKE_JOINER_MODES", "").split(",") if item
    )
    mode = modes.get(str(engine_id), "ready")
    if mode == "exit":
        sys.exit(3)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    sock.send(encode(EngineHello(engine_id, os.getpid())))
    addresses = msgspec.msgpack.decode(sock.recv(), type=EngineAddresses)
    error = None
    if mode == "error":
        error = "boom"
    elif not addresses.joining or addresses.topology is None or engine_id not in addresses.topology:
        error = f"bad handshake answer: {addresses}"
    sock.send(encode(EngineReady(engine_id, addresses.parallel_config_hash, 7, error)))
    sock.close()
    ctx.term()
    if error is not None:
        sys.exit(1)
    signal.pause()
