"""The shared-memory broadcast queue (tidal/distributed/shm_queue.py) on its C atomics and on
its pure-Python reference: wrap-around of the ring, payloads that overflow to ZMQ, a slow
reader holding the writer back, a reader that dies, a writer that dies, cancel and close
while readers sleep, the creator-only unlink, and a /dev/shm too small.

Readers run as threads where the protocol is all that is tested (it does not care who
maps the segment) and as real processes where a process must attach, die or be killed.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import psutil
import pytest

from tests.waiting import wait_until
from tidal.distributed import shm_queue
from tidal.distributed.shm_queue import (
    QueueCancelled,
    QueueClosed,
    ReaderGone,
    ShmQueueReader,
    ShmQueueWriter,
    ShmTooSmall,
)
from tidal.protocol.worker import ShmQueueHandle

IMPLS = [
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(not shm_queue.native_available(), reason="_shm_sync not built"),
    ),
    pytest.param(False, id="python"),
]
CHUNK = 1024


@pytest.fixture
def track():
    """``track(obj)`` returns ``obj`` and closes (queues) or kills (processes) it at the end
    of the test, passed or failed: a failing test leaves no segment or process behind."""
    held: list = []
    yield lambda obj: held.append(obj) or obj
    for obj in reversed(held):
        if isinstance(obj, subprocess.Popen):
            obj.kill()
            obj.wait(30)
        else:
            obj.close()


def _payload(i: int) -> bytes:
    # Sizes around the inline limit (chunk - 16) and well past it (overflow).
    size = (0, 1, 100, CHUNK - 16, CHUNK - 15, 5 * CHUNK, 3)[i % 7] + i % 5
    return bytes((i + k) % 251 for k in range(size))


def _segments() -> set[str]:
    return leftover_segments()


def leftover_segments() -> set[str]:
    """The queue segments in /dev/shm that this test run may have made: those of this
    process, of its descendants, or of creators that are gone (a leak). A live unrelated
    process's segment (another run on the machine) is not ours to count."""
    me = psutil.Process()
    ours = {me.pid} | {p.pid for p in me.children(recursive=True)}
    out = set()
    for name in os.listdir(shm_queue.SHM_DIR):
        if not name.startswith(shm_queue.NAME_PREFIX):
            continue
        pid = int(name[len(shm_queue.NAME_PREFIX) :].split("-")[0])
        if pid in ours or not psutil.pid_exists(pid):
            out.add(name)
    return out


def _read_in_thread(
    reader: ShmQueueReader, n: int, out: list, delay_s: float = 0.0
) -> threading.Thread:
    def run() -> None:
        try:
            for _ in range(n):
                out.append(reader.get(timeout_s=60))
                if delay_s:
                    time.sleep(delay_s)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("native", IMPLS)
def test_every_reader_gets_every_message_in_order_across_wraps_and_overflows(native, track):
    before = _segments()
    writer = track(ShmQueueWriter(2, chunk_bytes=CHUNK, num_chunks=3, native=native))
    readers = [track(ShmQueueReader(writer.handle, r, native=native)) for r in range(2)]
    assert writer.wait_for_readers(10) == [os.getpid()] * 2
    writer.unlink()  # the mappings stay valid
    assert writer.name not in _segments()
    n = 60  # 20 laps of a 3-chunk ring
    got: list[list] = [[], []]
    threads = [_read_in_thread(r, n, out) for r, out in zip(readers, got)]
    for i in range(n):
        writer.put(_payload(i), timeout_s=30)
    for t in threads:
        t.join(60)
    for out in got:
        assert out == [_payload(i) for i in range(n)]
    assert writer.overflows == sum(len(_payload(i)) > CHUNK - 16 for i in range(n)) > 0
    for r in readers:
        r.close()
    writer.close()
    assert _segments() == before


@pytest.mark.parametrize("native", IMPLS)
def test_a_slow_reader_holds_the_writer_back_and_loses_nothing(native, track):
    writer = track(ShmQueueWriter(2, chunk_bytes=CHUNK, num_chunks=2, native=native))
    fast, slow = (track(ShmQueueReader(writer.handle, r, native=native)) for r in range(2))
    writer.wait_for_readers(10)
    writer.put(b"a")
    writer.put(b"b")
    assert fast.get(5) == b"a" and fast.get(5) == b"b"
    with pytest.raises(TimeoutError):  # chunk 0 is still unread by the slow reader
        writer.put(b"c", timeout_s=0.3)
    assert slow.get(5) == b"a"
    writer.put(b"c", timeout_s=5)  # its chunk is free now
    assert [slow.get(5), slow.get(5), fast.get(5)] == [b"b", b"c", b"c"]
    with pytest.raises(TimeoutError):
        fast.get(timeout_s=0.2)
    for q in (fast, slow, writer):
        q.close()


@pytest.mark.parametrize("native", IMPLS)
def test_close_and_cancel_wake_sleeping_readers(native, track):
    writer = track(ShmQueueWriter(2, chunk_bytes=CHUNK, num_chunks=4, native=native))
    r0, r1 = (track(ShmQueueReader(writer.handle, r, native=native)) for r in range(2))
    writer.wait_for_readers(10)
    out0: list = []
    out1: list = []
    t1 = _read_in_thread(r1, 1, out1)
    writer.put(b"last words")
    assert wait_until(lambda: out1 == [b"last words"], 30)
    t1.join(10)
    t1 = _read_in_thread(r1, 1, out1)  # blocks: nothing more comes
    assert wait_until(lambda: r1.sleeps > 0, 30)  # asleep, not spinning
    r1.cancel()
    t1.join(10)
    assert isinstance(out1[-1], QueueCancelled)
    writer.close()  # a message published before the close is still delivered
    t0 = _read_in_thread(r0, 2, out0)
    t0.join(30)
    assert out0[0] == b"last words" and isinstance(out0[1], QueueClosed)
    with pytest.raises(QueueClosed):
        writer.put(b"after")
    r0.close()
    r1.close()


def test_a_segment_smaller_than_needed_is_a_clear_error(monkeypatch):
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(
        shm_queue.os, "statvfs", lambda p: Tiny() if p == shm_queue.SHM_DIR else real(p)
    )
    need = shm_queue.segment_bytes(2, 8, 1 << 20)
    before = _segments()
    with pytest.raises(ShmTooSmall, match=f"needs {need} bytes") as e:
        ShmQueueWriter(2)
    assert "40960 bytes free" in str(e.value) and "--shm-size" in str(e.value)
    assert _segments() == before


# ---------------------------------------------------------------- real processes

_READER = """
import hashlib, sys, msgspec
from tidal.protocol.worker import ShmQueueHandle
from tidal.distributed.shm_queue import ShmQueueReader
handle = msgspec.msgpack.decode(bytes.fromhex(sys.argv[1]), type=ShmQueueHandle)
rank, count, fd = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
reader = ShmQueueReader(handle, rank, fd=fd)
print("attached", flush=True)
h = hashlib.sha256()
for _ in range(count):
    h.update(reader.get(timeout_s=60))
print(h.hexdigest(), flush=True)
reader.close()
"""

_WRITER = """
import sys, msgspec, time
from tidal.distributed.shm_queue import ShmQueueWriter
writer = ShmQueueWriter(1, chunk_bytes=1024, num_chunks=2)
print(msgspec.msgpack.encode(writer.handle).hex(), flush=True)
writer.wait_for_readers(60)
writer.unlink()
print("ready", flush=True)
time.sleep(600)
"""


def _python(code: str, *args: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        pass_fds=pass_fds,
    )


def _start_reader(writer: ShmQueueWriter, rank: int, count: int, inherit: bool) -> subprocess.Popen:
    handle = msgspec.msgpack.encode(writer.handle).hex()
    fd = writer.fd if inherit else -1
    return _python(
        _READER, handle, str(rank), str(count), str(fd), pass_fds=(writer.fd,) if inherit else ()
    )


def test_reader_processes_by_name_and_by_inherited_descriptor(track):
    before = _segments()
    writer = track(ShmQueueWriter(2, chunk_bytes=CHUNK, num_chunks=3))
    n = 40
    procs = [
        track(_start_reader(writer, 0, n, inherit=True)),
        track(_start_reader(writer, 1, n, inherit=False)),
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "attached"
    writer.wait_for_readers(60)
    writer.unlink()
    expected = hashlib.sha256()
    for i in range(n):
        writer.put(_payload(i), timeout_s=60)
        expected.update(_payload(i))
    for p in procs:
        assert p.stdout.readline().strip() == expected.hexdigest()
        assert p.wait(60) == 0
    writer.close()
    assert _segments() == before


def test_a_dead_reader_fails_the_writer_instead_of_hanging_it(track):
    writer = track(ShmQueueWriter(2, chunk_bytes=CHUNK, num_chunks=2))
    alive = track(ShmQueueReader(writer.handle, 0))
    victim = track(_start_reader(writer, 1, 10**6, inherit=True))
    assert victim.stdout.readline().strip() == "attached"
    writer.wait_for_readers(60)
    writer.unlink()
    victim.send_signal(signal.SIGSTOP)  # it reads nothing from now on
    writer.put(b"1", timeout_s=10)
    writer.put(b"2", timeout_s=10)
    assert alive.get(5) == b"1"
    victim.kill()
    victim.wait(10)
    t0 = time.monotonic()
    with pytest.raises(ReaderGone, match=f"reader 1 \\(pid {victim.pid}\\)"):
        writer.put(b"3", timeout_s=120)
    assert time.monotonic() - t0 < 60  # seen by its pid, long before the timeout
    alive.close()
    writer.close()


def test_a_dead_writer_closes_the_queue_for_its_readers_and_leaves_no_segment(track):
    before = _segments()
    proc = _python(_WRITER)
    try:
        handle = msgspec.msgpack.decode(bytes.fromhex(proc.stdout.readline()), type=ShmQueueHandle)
        reader = track(ShmQueueReader(handle, 0))
        assert proc.stdout.readline().strip() == "ready"
        assert handle.name not in _segments()  # unlinked by its creator once attached
        out: list = []
        t = _read_in_thread(reader, 1, out)
        assert wait_until(lambda: reader.sleeps > 0, 30)
        proc.kill()
        proc.wait(10)
        t.join(30)
        assert len(out) == 1 and isinstance(out[0], QueueClosed), out
        reader.close()
    finally:
        proc.kill()
        proc.wait(10)
    assert _segments() == before
