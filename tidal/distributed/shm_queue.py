"""A one-writer, many-reader broadcast queue in shared memory (docs/architecture.md#tensor-parallel): the engine
core hands each step's input to its tensor-parallel workers through it.

Why not ZMQ PUB/SUB alone: a message then costs a syscall and a copy per reader on each
side, and a wake-up through the kernel even when the reader is already waiting for it;
here the writer copies the payload once into a chunk of a ring that every reader maps,
and a reader that is polling sees it within a few hundred nanoseconds
(``benchmarks/tp.py`` measures both in the same run).

Segment (``/dev/shm/tidal-shmq-*``, mode 0600), 32-bit words, 64-byte aligned parts::

    header   magic | readers | chunks | chunk bytes | closed | seq | writer pid
    readers  one cache line each: pid (attached) | sleeping
    meta     one line per chunk: written | read[0] .. read[R-1]
    data     chunks of ``chunk_bytes``: kind | length (u64) | payload

Protocol, per chunk (the ring index advances with every message):

- writer: wait until the chunk is free (never written, or every reader's ``read`` flag is
  set: acquire loads, so the readers' copies are done); ``written = 0``, then every
  ``read = 0`` (release: a reader that sees its flag cleared also sees ``written = 0``),
  then the payload, then ``written = 1`` (release), then ``seq += 1`` and, if a reader
  sleeps, a futex wake on ``seq``.
- reader: ready when its own ``read`` flag is 0 *and then* ``written`` is 1 (loaded in that
  order, both acquire, so a flag cleared by a writer that is mid-reset never pairs with
  the previous lap's ``written``); copy the payload; ``read = 1`` (release).

Sleep and wake (two cores cannot afford spinners): a reader polls for ``spin_s`` (with
``sched_yield``) -- only where the host has more than two cores per reader: on fewer a
spinning reader takes the core the writer needs, and measured on 2 busy cores a reader
that sleeps at once sees each message sooner (``benchmarks/tp.py``) -- then sets its
``sleeping`` word, reads ``seq``, checks once more and
sleeps on the futex of ``seq`` while it still holds that value. The writer's ``seq``
store and its load of ``sleeping`` are sequentially consistent, as are the reader's
``sleeping`` store and its load of ``seq``: either the writer sees the sleeper and wakes
it, or the reader sees the new ``seq`` (the futex then returns at once). Readers sleep
at most ``poll_s`` at a time and then check the writer is alive, the queue open and
their own ``cancel``.

Memory ordering is real: the atomics and the futex are C (``_shm_sync``, built with the
package). Without it the same protocol runs on the slow reference: plain loads and
stores between full fences (a lock acquire/release) and a sleep with backoff instead of
the futex; ``tests/unit/test_shm_queue.py`` runs every case on both.

Payloads larger than a chunk overflow: the chunk says so (kind 1, length) and the bytes
go out on the writer's ZMQ XPUB socket, which every reader subscribed to at attach
(the writer counts the subscriptions before the first message, so none is missed). The
ring still orders them: a reader takes the overflow message when it reaches its chunk.

Lifetime: the creator (the writer) alone unlinks the segment -- as soon as every reader
has mapped it (``unlink``), so a process killed later leaves nothing in /dev/shm; the
mappings live on until each side closes. A creator killed before that leaves the name
(``tidal-shmq-<its pid>-...``); ``remove_orphaned_segments`` (the next TP start) removes
what creators that are gone left. Readers may also inherit the descriptor
(``ShmQueueReader(fd=...)``) so the name can go even before they start. ``close``
marks the queue closed and wakes every reader (``QueueClosed``). A reader whose writer
died gets ``QueueClosed`` too; a writer blocked on a full ring whose reader died gets
``ReaderGone``. /dev/shm smaller than the segment is a ``ShmTooSmall`` at creation,
naming the bytes needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from tidal.protocol.worker import ShmQueueHandle

_native: Any  # the C module, or None
try:  # C atomics and futex (setup.py builds it; optional; no stubs for a type checker)
    from tidal.distributed import _shm_sync as _native  # pyright: ignore[reportAttributeAccessIssue]
except ImportError:  # pragma: no cover - exercised by forcing native=False in the tests
    _native = None

SHM_DIR = "/dev/shm"
NAME_PREFIX = "tidal-shmq-"
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_NUM_CHUNKS = 8
SPIN_S = 50e-6  # a reader polls this long before it sleeps (hosts with spare cores)
POLL_S = 0.1  # longest sleep between liveness checks

_MAGIC = 0x51445454  # "TTDQ"
_LINE = 64
_H_MAGIC, _H_READERS, _H_CHUNKS, _H_CHUNK_BYTES, _H_CLOSED, _H_SEQ, _H_WRITER = range(0, 28, 4)
_R_PID, _R_SLEEPING = 0, 4
_KIND_INLINE, _KIND_OVERFLOW = 0, 1
_DATA_HEADER = 16  # kind u32, pad u32, length u64
_HEADER = struct.Struct("<IIQ")
_U32 = 0xFFFFFFFF


class QueueClosed(RuntimeError):
    """The writer closed the queue, or died."""


class QueueCancelled(RuntimeError):
    """``cancel()`` was called on this reader (e.g. its process is shutting down)."""


class ReaderGone(RuntimeError):
    """A reader died or never attached while the writer waited for it."""


class ShmTooSmall(OSError):
    """/dev/shm cannot hold the segment."""


def native_available() -> bool:
    return _native is not None


def default_spin_s(num_readers: int) -> float:
    """``SPIN_S`` where the host has more than two cores per reader, else 0."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return SPIN_S if (cores or 1) > 2 * num_readers else 0.0


def segment_bytes(num_readers: int, num_chunks: int, chunk_bytes: int) -> int:
    """Size of the segment of a queue with this geometry."""
    return _data_offset(num_readers, num_chunks) + num_chunks * chunk_bytes


def _align(n: int) -> int:
    return -(-n // _LINE) * _LINE


def _meta_stride(num_readers: int) -> int:
    return _align(4 * (1 + num_readers))


def _data_offset(num_readers: int, num_chunks: int) -> int:
    return _LINE + num_readers * _LINE + num_chunks * _meta_stride(num_readers)


class _Sync:
    """Loads, stores and waits on the segment's 32-bit words (absolute addresses)."""

    def __init__(self, native: bool | None) -> None:
        use = native_available() if native is None else native
        if use and _native is None:
            raise RuntimeError("the shm queue's C helpers (_shm_sync) are not built")
        self.native = use
        if use:
            n = _native
            self.load, self.store = n.load_acquire, n.store_release
            self.load_sc, self.store_sc = n.load_seq_cst, n.store_seq_cst
        else:
            self._fence_lock = threading.Lock()
            self.load = self.load_sc = self._py_load
            self.store = self.store_sc = self._py_store

    # The slow reference: a plain access between two full fences. CPython's lock
    # acquire/release are atomic read-modify-writes (full barriers on x86 and ARM).
    def _fence(self) -> None:
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _py_load(self, addr: int) -> int:
        self._fence()
        v = ctypes.c_uint32.from_address(addr).value
        self._fence()
        return v

    def _py_store(self, addr: int, value: int) -> None:
        self._fence()
        ctypes.c_uint32.from_address(addr).value = value
        self._fence()

    def wait(self, addr: int, expected: int, timeout_s: float, backoff: list[float]) -> None:
        """Sleep while the word holds ``expected`` (at most ``timeout_s``)."""
        if self.native:
            _native.futex_wait(addr, expected, timeout_s)
            return
        delay = backoff[0] = min(backoff[0] * 2, 2e-3, timeout_s) if backoff[0] else 20e-6
        time.sleep(delay)

    def wake(self, addr: int) -> None:
        if self.native:
            _native.futex_wake(addr, _U32)


class _Segment:
    """The mapping of a queue's segment and the addresses of its words."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)

    def read_u32(self, offset: int) -> int:
        return int.from_bytes(self.mm[offset : offset + 4], "little")

    def close(self) -> None:
        self._anchor = None
        with contextlib.suppress(BufferError):
            self.mm.close()


class _Geometry:
    def __init__(self, num_readers: int, num_chunks: int, chunk_bytes: int) -> None:
        if num_readers < 1 or num_chunks < 2 or chunk_bytes < 256 or chunk_bytes % _LINE:
            raise ValueError(
                "a queue needs >= 1 reader, >= 2 chunks and chunks of >= 256 bytes "
                f"(a multiple of {_LINE}); got {num_readers}, {num_chunks}, {chunk_bytes}"
            )
        self.num_readers = num_readers
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.meta_stride = _meta_stride(num_readers)
        self.data = _data_offset(num_readers, num_chunks)
        self.size = self.data + num_chunks * chunk_bytes
        self.max_inline = chunk_bytes - _DATA_HEADER

    def reader(self, r: int) -> int:
        return _LINE + r * _LINE

    def written(self, chunk: int) -> int:
        return _LINE + self.num_readers * _LINE + chunk * self.meta_stride

    def read_flag(self, chunk: int, r: int) -> int:
        return self.written(chunk) + 4 + 4 * r

    def payload(self, chunk: int) -> int:
        return self.data + chunk * self.chunk_bytes


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie -- dead, not yet reaped -- counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc: trust kill
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def owner_gone(name: str, prefix: str) -> bool:
    """Whether ``name`` is ``prefix``, the pid of a process that is gone, ``-`` and more:
    what an owner that died left behind. A live owner's (or another naming) is not."""
    if not name.startswith(prefix):
        return False
    pid, sep, _ = name[len(prefix) :].partition("-")
    return bool(sep) and pid.isdigit() and int(pid) > 0 and not _pid_alive(int(pid))


def remove_orphaned_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the queue segments whose creator died before it unlinked them (killed in
    the moment between creating a ring and its workers attaching); a live creator's are
    kept. The names removed."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if owner_gone(name, NAME_PREFIX):
            with contextlib.suppress(OSError):  # e.g. another sweep was first
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
    return removed


class ShmQueueWriter:
    """The writing end; its creator. ``handle`` is what readers attach with."""

    def __init__(
        self,
        num_readers: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_chunks: int = DEFAULT_NUM_CHUNKS,
        ctx: zmq.Context | None = None,
        overflow_address: str | None = None,
        native: bool | None = None,
        shm_dir: str = SHM_DIR,
    ) -> None:
        """``overflow_address``: where the XPUB socket binds (an ``ipc://`` path in a
        private directory, or ``tcp://127.0.0.1:0``: the bound address is in ``handle``)."""
        self.geo = g = _Geometry(num_readers, num_chunks, chunk_bytes)
        self.sync = _Sync(native)
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(shm_dir, self.name)
        self.fd = _create_segment(self.path, g.size, shm_dir)
        self._unlinked = False
        self._closed = False
        self._sub_count = 0
        try:
            self.seg = _Segment(self.fd, g.size)
            base = self.seg.base
            s = self.sync
            s.store(base + _H_READERS, num_readers)
            s.store(base + _H_CHUNKS, num_chunks)
            s.store(base + _H_CHUNK_BYTES, chunk_bytes)
            s.store(base + _H_WRITER, os.getpid())
            s.store(base + _H_MAGIC, _MAGIC)
            self._own_ctx = ctx is None
            self.ctx = ctx or zmq.Context()
            self.pub = self.ctx.socket(zmq.XPUB)
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every reader's subscription
            self.pub.setsockopt(zmq.SNDHWM, 0)  # the ring bounds what is in flight
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(overflow_address or "tcp://127.0.0.1:0")
            address = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._release()
            raise
        self.handle = ShmQueueHandle(self.name, num_readers, num_chunks, chunk_bytes, address)
        self._next = 0  # ring index of the next message
        self._seq = 0
        self._base = base
        self._seq_addr = base + _H_SEQ
        self._sleeping = [base + g.reader(r) + _R_SLEEPING for r in range(num_readers)]
        # Per chunk: the address of its written word and of each reader's read flag.
        self._written = [base + g.written(c) for c in range(num_chunks)]
        self._flags = [
            [base + g.read_flag(c, r) for r in range(num_readers)] for c in range(num_chunks)
        ]
        self._reader_pids: list[int] = [0] * num_readers
        self.messages = 0
        self.overflows = 0

    # ---- startup ------------------------------------------------------------------------

    def wait_for_readers(
        self, timeout_s: float = 60.0, abort: Callable[[], str | None] | None = None
    ) -> list[int]:
        """Block until every reader mapped the segment and subscribed to the overflow
        socket; returns their pids in reader order. ``abort()`` returning a reason (a
        reader process exited) raises ``ReaderGone`` at once; so does the timeout."""
        g, s = self.geo, self.sync
        deadline = time.monotonic() + timeout_s
        while True:
            pids = [s.load(self._base + g.reader(r) + _R_PID) for r in range(g.num_readers)]
            while self.pub.poll(0):
                if self.pub.recv()[:1] == b"\x01":
                    self._sub_count += 1
            if all(pids) and self._sub_count >= g.num_readers:
                self._reader_pids = pids
                return pids
            why = abort() if abort is not None else None
            if why is not None:
                raise ReaderGone(why)
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(pids) if not p]
                raise ReaderGone(
                    f"readers {missing} did not attach to the shm queue within {timeout_s:g}s"
                )
            self.pub.poll(10)

    def unlink(self) -> None:
        """Remove the segment's name (the mappings stay valid). Idempotent; the creator's
        alone."""
        if not self._unlinked:
            self._unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # ---- writing ------------------------------------------------------------------------

    def put(
        self,
        data: bytes | bytearray | memoryview,
        timeout_s: float | None = None,
        abort: Callable[[], str | None] | None = None,
    ) -> None:
        """Publish ``data`` to every reader. Blocks while the next chunk is still unread
        (the ring is full): ``ReaderGone`` if a reader dies meanwhile (or ``abort()``
        gives a reason), ``TimeoutError`` after ``timeout_s``."""
        if self._closed:
            raise QueueClosed("the shm queue is closed")
        g, s = self.geo, self.sync
        chunk = self._next
        written, flags = self._written[chunk], self._flags[chunk]
        load = s.load
        if load(written) and not all(load(f) for f in flags):
            self._wait_free(chunk, written, flags, timeout_s, abort)
        store = s.store
        store(written, 0)
        for f in flags:
            store(f, 0)
        n = len(data)
        at = g.payload(chunk)
        mm = self.seg.mm
        if n <= min(4096, g.max_inline):  # one copy into the segment
            mm[at : at + _DATA_HEADER + n] = _HEADER.pack(_KIND_INLINE, 0, n) + data
        elif n <= g.max_inline:
            mm[at : at + _DATA_HEADER] = _HEADER.pack(_KIND_INLINE, 0, n)
            mm[at + _DATA_HEADER : at + _DATA_HEADER + n] = data
        else:
            mm[at : at + _DATA_HEADER] = _HEADER.pack(_KIND_OVERFLOW, 0, n)
            self.pub.send(data, copy=n < 65536)
            self.overflows += 1
        store(written, 1)
        self._seq = (self._seq + 1) & _U32
        s.store_sc(self._seq_addr, self._seq)
        load_sc = s.load_sc
        for a in self._sleeping:
            if load_sc(a):
                s.wake(self._seq_addr)
                break
        self._next = (chunk + 1) % g.num_chunks
        self.messages += 1

    def _wait_free(
        self,
        chunk: int,
        written: int,
        flags: list[int],
        timeout_s: float | None,
        abort: Callable[[], str | None] | None,
    ) -> None:
        g, load = self.geo, self.sync.load
        base = self._base
        start = time.monotonic()
        next_check = start + POLL_S
        delay = 0.0
        while True:
            if not load(written) or all(load(f) for f in flags):
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + POLL_S
                slow = [r for r, f in enumerate(flags) if not load(f)]
                for r in slow:
                    pid = self._reader_pids[r] or load(base + g.reader(r) + _R_PID)
                    if not _pid_alive(pid):
                        raise ReaderGone(f"shm queue reader {r} (pid {pid}) is gone")
                why = abort() if abort is not None else None
                if why is not None:
                    raise ReaderGone(why)
            if timeout_s is not None and now - start > timeout_s:
                raise TimeoutError(
                    f"shm queue: a reader left chunk {chunk} unread for {timeout_s:g}s"
                )
            if now - start < SPIN_S:
                os.sched_yield()
            else:
                delay = min(2 * delay or 20e-6, 1e-3)
                time.sleep(delay)

    # ---- shutdown -----------------------------------------------------------------------

    def close(self) -> None:
        """Mark the queue closed (readers get ``QueueClosed`` once they took what was
        published), wake every reader, release the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        s = self.sync
        s.store_sc(self._base + _H_CLOSED, 1)
        self._seq = (self._seq + 1) & _U32
        s.store_sc(self._seq_addr, self._seq)
        s.wake(self._seq_addr)
        self._release()

    def _release(self) -> None:
        self.unlink()
        seg = getattr(self, "seg", None)
        if seg is not None:
            seg.close()
        pub = getattr(self, "pub", None)
        if pub is not None:
            pub.close(linger=0)
        if getattr(self, "_own_ctx", False):
            self.ctx.term()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _create_segment(path: str, size: int, shm_dir: str) -> int:
    try:
        st = os.statvfs(shm_dir)
    except OSError as e:
        raise ShmTooSmall(f"{shm_dir} is not usable for the TP broadcast queue: {e}") from e
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise ShmTooSmall(_too_small(shm_dir, size, free))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve the pages now: a tmpfs that runs out later would SIGBUS the writer.
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise ShmTooSmall(_too_small(shm_dir, size, free, e)) from e
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return fd


def _too_small(shm_dir: str, size: int, free: int, err: OSError | None = None) -> str:
    why = f" ({err.strerror})" if err is not None else ""
    return (
        f"{shm_dir} has {free} bytes free{why}, but the tensor-parallel broadcast queue "
        f"needs {size} bytes ({size / 2**20:.1f} MiB) per engine rank: enlarge it (e.g. "
        f"`docker run --shm-size={max(64, -(-size * 4 // 2**20))}m`) or free space there"
    )


class ShmQueueReader:
    """Reader ``rank`` of a queue (ranks 0..R-1, one process each)."""

    def __init__(
        self,
        handle: ShmQueueHandle,
        rank: int,
        *,
        fd: int = -1,
        ctx: zmq.Context | None = None,
        native: bool | None = None,
        shm_dir: str = SHM_DIR,
        spin_s: float | None = None,
    ) -> None:
        """``fd``: the segment's descriptor, inherited from the creator (else the name is
        opened: the creator must not have unlinked it yet). ``spin_s``: how long ``get``
        polls before it sleeps; None: ``default_spin_s``."""
        self.geo = g = _Geometry(handle.num_readers, handle.num_chunks, handle.chunk_bytes)
        if not 0 <= rank < g.num_readers:
            raise ValueError(f"reader rank must be in [0, {g.num_readers}), got {rank}")
        self.rank = rank
        self.sync = _Sync(native)
        self.spin_s = default_spin_s(g.num_readers) if spin_s is None else spin_s
        self._cancelled = False
        self._closed = False
        own_fd = fd < 0
        if own_fd:
            fd = os.open(os.path.join(shm_dir, handle.name), os.O_RDWR)
        try:
            self.seg = _Segment(fd, g.size)
        finally:
            if own_fd:
                os.close(fd)
        base = self.seg.base
        if self.sync.load(base + _H_MAGIC) != _MAGIC:
            self.seg.close()
            raise ValueError(f"{handle.name} is not a tidal shm queue")
        self._base = base
        self._seq_addr = base + _H_SEQ
        self._closed_addr = base + _H_CLOSED
        self._sleeping = base + g.reader(rank) + _R_SLEEPING
        self._writer_pid = self.sync.load(base + _H_WRITER)
        self._written = [base + g.written(c) for c in range(g.num_chunks)]
        self._flags = [base + g.read_flag(c, rank) for c in range(g.num_chunks)]
        self._next = 0
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(handle.overflow_address)
        self.sync.store(base + g.reader(rank) + _R_PID, os.getpid())
        self.sleeps = 0

    def get(self, timeout_s: float | None = None) -> bytes:
        """The next message. Spins ``spin_s``, then sleeps. ``QueueClosed`` when the writer
        closed the queue (after every message it published) or died; ``QueueCancelled``
        after ``cancel()``; ``TimeoutError`` after ``timeout_s``."""
        g, s = self.geo, self.sync
        chunk = self._next
        flag, written = self._flags[chunk], self._written[chunk]
        load = s.load
        if load(flag) or not load(written):
            self._wait(flag, written, timeout_s)
        at = g.payload(chunk)
        mm = self.seg.mm
        kind, _, n = _HEADER.unpack_from(mm, at)
        if kind == _KIND_INLINE:
            data = mm[at + _DATA_HEADER : at + _DATA_HEADER + n]
        else:
            data = self._recv_overflow(n)
        s.store(flag, 1)
        self._next = (chunk + 1) % g.num_chunks
        return data

    def _ready(self, flag: int, written: int) -> bool:
        load = self.sync.load
        return not load(flag) and bool(load(written))

    def _wait(self, flag: int, written: int, timeout_s: float | None) -> None:
        s = self.sync
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        spin_until = start + self.spin_s
        while time.monotonic() < spin_until:
            if self._ready(flag, written):
                return
            os.sched_yield()
        backoff = [0.0]
        while True:
            self._check(deadline)
            s.store_sc(self._sleeping, 1)
            seq = s.load_sc(self._seq_addr)
            if self._ready(flag, written):
                s.store(self._sleeping, 0)
                return
            self._check(deadline)
            nap = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            self.sleeps += 1
            s.wait(self._seq_addr, seq, nap, backoff)
            s.store(self._sleeping, 0)
            if self._ready(flag, written):
                return

    def _check(self, deadline: float | None) -> None:
        if self._cancelled:
            raise QueueCancelled("the shm queue reader was cancelled")
        if self.sync.load(self._closed_addr):
            raise QueueClosed("the shm queue was closed by its writer")
        if not _pid_alive(self._writer_pid):
            raise QueueClosed(f"the shm queue's writer (pid {self._writer_pid}) is gone")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("shm queue: no message")

    def _recv_overflow(self, n: int) -> bytes:
        while True:
            if self.sub.poll(int(POLL_S * 1000)):
                data = self.sub.recv(copy=True)
                if len(data) != n:
                    raise RuntimeError(f"shm queue: overflow of {len(data)} bytes, expected {n}")
                return data
            self._check(None)

    def cancel(self) -> None:
        """From another thread: make a blocked or later ``get`` raise ``QueueCancelled``."""
        self._cancelled = True
        self.sync.wake(self._seq_addr)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.seg.close()
        self.sub.close(linger=0)
        if self._own_ctx:
            self.ctx.term()
