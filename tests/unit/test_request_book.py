"""The client's request book (elastic EP migration bookkeeping, docs/architecture.md#elastic-migration) and the
client's migration path over it (``AsyncMPClient.migrate`` / ``_on_outputs``) with fake
sockets: no processes."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
import zmq

from tests.waiting import wait_until
from tidal.elastic.migration import AlreadyFinished, ResumedRequest
from tidal.frontend.async_client import AsyncMPClient, PendingCalls
from tidal.frontend.dp_state import DPFrontendState
from tidal.frontend.liveness_monitor import LivenessMonitor, ScaleHooks
from tidal.frontend.migrator import Migrator
from tidal.frontend.request_book import RequestBook
from tidal.frontend.router import Router
from tidal.frontend.transport import EngineTransport, engine_input_router
from tidal.protocol.elastic import ScaleCommit, ScaleEvent, ScaleReport
from tidal.protocol.errors import RankUnavailableError
from tidal.protocol.messages import (
    DPSetTopology,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    Logprobs,
    engine_id_of,
    engine_identity,
)
from tidal.protocol.topology import Topology
from tidal.sampling_params import SamplingParams

EOS = 2


def req(rid: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [5, 6, 7], SamplingParams(**params), eos_token_id=EOS)


def pinned(rid: str, rank: int) -> EngineCoreRequest:
    r = req(rid)
    r.data_parallel_rank = rank
    return r


def out(rid: str, *tokens: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(tokens), finish_reason=finish)


# ----------------------------------------------------------------------------- the book


def test_only_the_owner_outputs_pass_and_are_recorded():
    book = RequestBook()
    book.add(req("a", max_tokens=10), 0)
    book.add(req("b", max_tokens=10), 1)
    kept = book.accept(0, [out("a", 11), out("b", 99), out("zzz", 1)])
    assert [o.request_id for o in kept] == ["a"]
    assert book.outputs("a") == [11] and book.outputs("b") == []
    assert book.dropped_outputs == 1  # b from engine 0; unknown "zzz" is not counted
    kept = book.accept(1, [out("b", 21, 22, finish=FinishReason.LENGTH)])
    assert len(kept) == 1 and "b" not in book and len(book) == 1


def test_moved_request_resumes_from_what_was_accepted_and_drops_the_old_owner():
    book = RequestBook()
    book.add(req("a", max_tokens=10, min_tokens=0), 3)
    book.accept(3, [out("a", 11, 12)])
    (item,) = book.take(3, ["a", "gone"])  # an unknown id is skipped
    assert isinstance(item, ResumedRequest)
    assert item.prompt_token_ids == [5, 6, 7, 11, 12] and item.num_output_tokens == 2
    wire = item.to_engine_request(current_wave=4)
    assert wire.num_output_tokens == 2 and wire.current_wave == 4
    assert book.blocked_targets("a", [0, 3, 4]) == {3}
    book.moved(item, 4, old_owner_stopped=True)
    assert book.owner("a") == 4 and book.migrated == 1
    assert book.accept(3, [out("a", 13)]) == []  # the old owner's late output
    assert [o.new_token_ids for o in book.accept(4, [out("a", 13)])] == [[13]]
    assert book.outputs("a") == [11, 12, 13]
    assert book.take(3) == []  # it owns nothing any more


def test_take_all_of_an_engine_and_already_finished_requests():
    book = RequestBook()
    book.add(req("len", max_tokens=2), 0)
    book.add(req("eos", max_tokens=9), 0)
    book.add(req("stop", max_tokens=9, stop_token_ids=[42]), 0)
    book.add(req("more", max_tokens=9), 0)
    book.add(req("other", max_tokens=9), 1)
    book.accept(0, [out("len", 8, 9), out("eos", 8, EOS), out("stop", 42), out("more", 8)])
    items = {i.request_id: i for i in book.take(0)}
    assert set(items) == {"len", "eos", "stop", "more"}
    assert isinstance(items["more"], ResumedRequest)
    finishes = {}
    for rid in ("len", "eos", "stop"):
        item = items[rid]
        assert isinstance(item, AlreadyFinished)
        finishes[rid] = book.finished_output(item)
        assert rid not in book
    assert finishes["len"].finish_reason is FinishReason.LENGTH
    assert (finishes["eos"].finish_reason, finishes["eos"].stop_reason) == (FinishReason.STOP, None)
    assert (finishes["stop"].finish_reason, finishes["stop"].stop_reason) == (FinishReason.STOP, 42)
    assert all(f.new_token_ids == [] for f in finishes.values())
    assert book.finished_on_move == 3 and len(book) == 2


def test_finish_and_abort_forget_requests():
    book = RequestBook()
    book.add(req("a"), 0)
    with pytest.raises(ValueError, match="already has an owner"):
        book.add(req("a"), 1)
    book.finish("a")
    book.finish("a")  # idempotent
    assert "a" not in book and book.accept(0, [out("a", 1)]) == []
    err = book.failed_output("x", "no engine")
    assert err.finish_reason is FinishReason.ERROR and err.stop_reason == "no engine"


def lps(*ids: int) -> list[Logprobs]:
    return [Logprobs([i], [-0.5], 1) for i in ids]


def test_a_request_moved_mid_prefill_asks_for_its_prompt_logprobs_again():
    """Chunked prefill: the client has positions 1-2 of a 6-token prompt when the engine
    goes; the resumed request asks again, and the repeats are dropped."""
    book = RequestBook()
    r = EngineCoreRequest("a", [5, 6, 7, 8, 9, 10], SamplingParams(prompt_logprobs=1))
    book.add(r, 0)
    first = EngineCoreOutput("a", [], new_prompt_logprobs=lps(6, 7))
    assert book.accept(0, [first]) == [first]
    (moved,) = book.take(0)
    assert isinstance(moved, ResumedRequest) and moved.prompt_logprobs_done == 2
    assert moved.sampling_params.prompt_logprobs == 1  # asked for again
    book.moved(moved, 1, old_owner_stopped=True)
    assert book.resumed_mid_prefill == 1
    again = [
        EngineCoreOutput("a", [], new_prompt_logprobs=lps(6)),  # chunk 1: a repeat
        EngineCoreOutput("a", [], new_prompt_logprobs=lps(7, 8)),  # half a repeat
        EngineCoreOutput("a", [11], new_prompt_logprobs=lps(9, 10)),
    ]
    kept = book.accept(1, again)
    assert [o.new_prompt_logprobs for o in kept] == [None, lps(8), lps(9, 10)]
    assert book.outputs("a") == [11]


def test_prompt_logprobs_returned_in_full_are_not_asked_for_again():
    book = RequestBook()
    book.add(EngineCoreRequest("a", [5, 6, 7], SamplingParams(prompt_logprobs=1)), 0)
    book.accept(0, [EngineCoreOutput("a", [], new_prompt_logprobs=lps(6, 7))])
    (moved,) = book.take(0)
    assert moved.prompt_logprobs_done is None and moved.sampling_params.prompt_logprobs is None


# ----------------------------------------------------------------------------- the client


class FakeSocket:
    def __init__(self, unreachable: set[int] | None = None) -> None:
        self.sent: list[list[bytes]] = []
        self.unreachable = unreachable if unreachable is not None else set()

    def send_multipart(self, frames: list[bytes]) -> None:
        if engine_id_of(frames[0]) in self.unreachable:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self.sent.append(frames)

    def send(self, frame: bytes) -> None:
        self.sent.append([frame])

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        raise zmq.Again()


def fake_client(topology: Topology) -> AsyncMPClient:
    """An AsyncMPClient with fake sockets and no processes: just its routing and book."""
    c = object.__new__(AsyncMPClient)
    c.transport = object.__new__(EngineTransport)  # its sending, over fake sockets
    c.transport.dead_reason = None
    c.transport.input_socket = FakeSocket()
    c.transport.upstream_socket = FakeSocket()
    book = RequestBook(topology.epoch)
    # No coordinator process: wake-ups go to the fake socket.
    c.router = Router(c.transport, topology, DPFrontendState(topology), book)
    c.migrator = Migrator(book, c.router, c._deliver_injected)
    c.calls = PendingCalls()
    c._queue = asyncio.Queue()  # _ensure_reader: already reading
    c._closed = False

    class _Manager:
        topology = None

        def set_topology(self, t: Topology) -> None:
            self.topology = t

    c.manager = _Manager()
    c.monitor = LivenessMonitor(
        c.router, c.manager, None, stall_s=0.0, fail=c._fail, fail_calls_to=c.calls.fail_engine
    )
    return c


def adds(sock: FakeSocket) -> list[tuple[int, EngineCoreRequest]]:
    return [
        (engine_id_of(f[0]), msgspec.msgpack.decode(f[2], type=EngineCoreRequest))
        for f in sock.sent
        if f[1] == EngineCoreRequestType.ADD.value
    ]


def test_client_migrates_handed_back_requests_and_filters_outputs():
    async def main() -> None:
        c = fake_client(Topology.initial(3))
        for i in range(6):
            c.add_request(req(f"r{i}", max_tokens=4, min_tokens=0))
        owners = {r.request_id: e for e, r in adds(c.input_socket)}
        assert set(owners.values()) == {0, 1, 2}
        on1 = sorted(r for r, e in owners.items() if e == 1)
        # Engine 1 leaves: excluded from routing, produced one token each, one finished.
        c.exclude_from_routing([1])
        done = on1[0]
        outs = EngineCoreOutputs(engine_id=1, outputs=[out(r, 9) for r in on1] + [out(done, EOS)])
        assert c._on_outputs(outs)
        c.input_socket.sent.clear()
        assert c.migrate(1, on1) == len(on1)
        moved = adds(c.input_socket)
        assert {r.request_id for _, r in moved} == set(on1) - {done}
        assert all(e != 1 for e, _ in moved)
        for e, r in moved:
            assert r.prompt_token_ids == [5, 6, 7, 9] and r.num_output_tokens == 1
            assert c.dp.rank_of[r.request_id] == e
        # The one whose outputs already ended it gets its finish, nothing is sent for it.
        injected = c._queue.get_nowait()
        assert [(o.request_id, o.finish_reason) for o in injected.outputs] == [
            (done, FinishReason.STOP)
        ]
        # Late outputs of engine 1 are dropped; the new owner's pass.
        e, r = moved[0]
        late = EngineCoreOutputs(engine_id=1, outputs=[out(r.request_id, 7)])
        c._on_outputs(late)
        assert late.outputs == []
        fresh = EngineCoreOutputs(engine_id=e, outputs=[out(r.request_id, 7)])
        c._on_outputs(fresh)
        assert len(fresh.outputs) == 1
        # Aborts leave the book; new requests avoid the excluded engine.
        c.abort_requests([r.request_id])
        assert r.request_id not in c.request_book
        c.input_socket.sent.clear()
        for i in range(4):
            c.add_request(req(f"n{i}"))
        assert all(e != 1 for e, _ in adds(c.input_socket))

    asyncio.run(main())


def test_client_migrates_every_request_of_a_dead_engine_and_topology_moves_on():
    async def main() -> None:
        c = fake_client(Topology.initial(2))
        c.exclude_from_routing([0])
        for i in range(3):
            c.add_request(req(f"r{i}", max_tokens=4))
        c.restore_routing([0])
        assert {e for e, _ in adds(c.input_socket)} == {1}
        new = Topology.initial(2).with_engines([0, 2])
        c.set_topology(new)
        assert (
            c.topology == new and c.manager.topology == new and c.request_book.ownership.epoch == 1
        )
        assert (
            msgspec.msgpack.decode(
                c.transport.upstream_socket.sent[-1][0], type=DPSetTopology
            ).topology
            == new
        )
        c.input_socket.sent.clear()
        assert c.migrate(1) == 3  # engine 1 is gone: everything it owned
        assert {e for e, _ in adds(c.input_socket)} <= {0, 2}
        assert c.request_book.owned_by(1) == []

    asyncio.run(main())


def test_scale_reports_go_to_the_hooks_not_to_the_caller():
    c = fake_client(Topology.initial(1))
    reports = []
    c.set_scale_hooks(ScaleHooks(reports.append, lambda e: False, lambda e, code: None))
    rep = ScaleReport("op", 0, 1, ScaleEvent.PREPARED)
    assert not c._on_outputs(EngineCoreOutputs(engine_id=0, scale_report=rep))
    assert reports == [rep]


def test_send_scale_retries_an_engine_whose_route_is_not_there_yet():
    async def main() -> None:
        c = fake_client(Topology.initial(2))
        c.input_socket.unreachable = {5, 7}
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, c.input_socket.unreachable.discard, 5)
        missing = await c.send_scale([0, 5, 7], ScaleCommit("op", 1), retry_s=0.3)
        assert missing == [7]
        assert [engine_id_of(f[0]) for f in c.input_socket.sent] == [0, 5]
        assert all(f[1] == EngineCoreRequestType.SCALE.value for f in c.input_socket.sent)

    asyncio.run(main())


def test_a_request_pinned_to_a_dead_rank_is_refused_and_to_a_leaving_one_rerouted():
    async def main() -> None:
        c = fake_client(Topology.initial(3))
        c.router.gone.add(1)  # dead; the recovery has not removed it yet
        c.exclude_from_routing([1])  # as the driver does on its exit
        with pytest.raises(RankUnavailableError, match="data_parallel_rank 1.*dead"):
            c.add_request(pinned("pinned-dead", 1))
        assert "pinned-dead" not in c.request_book and "pinned-dead" not in c.dp.rank_of
        c.add_request(pinned("pinned-live", 2))
        c.exclude_from_routing([0, 1])  # 0 leaves in a scale-down
        c.add_request(pinned("pinned-leaving", 0))
        sent = {r.request_id: (e, r.data_parallel_rank) for e, r in adds(c.input_socket)}
        assert sent["pinned-live"] == (2, 2)
        assert sent["pinned-leaving"][0] == 2 and sent["pinned-leaving"][1] is None

    asyncio.run(main())


def test_an_unreachable_engine_is_skipped_never_raised_to_the_caller():
    """An engine that is gone before its exit was seen: no route to it."""

    async def main() -> None:
        c = fake_client(Topology.initial(3))
        c.input_socket.unreachable = {0, 1}
        for i in range(4):
            c.add_request(req(f"r{i}"))
        assert {e for e, _ in adds(c.input_socket)} == {2}
        assert {c.request_book.owner(f"r{i}") for i in range(4)} == {2}
        with pytest.raises(RankUnavailableError):
            c.add_request(pinned("pinned", 1))
        assert "pinned" not in c.request_book and "pinned" not in c.dp.rank_of

    asyncio.run(main())


def test_an_abort_to_an_engine_gone_unseen_is_dropped_and_the_rest_go_out():
    """An abort for requests of an engine whose route has just vanished (the frontend
    processes its last outputs before its death is seen) raises nothing (the output
    handler would fail every stream), and the aborts for the other engines go out."""

    async def main() -> None:
        c = fake_client(Topology.initial(2))
        for i in range(4):
            c.add_request(req(f"r{i}"))
        owners = {r.request_id: e for e, r in adds(c.input_socket)}
        assert set(owners.values()) == {0, 1}
        c.input_socket.unreachable = {0}
        c.input_socket.sent.clear()
        c.abort_requests(list(owners))
        (frames,) = c.input_socket.sent
        assert engine_id_of(frames[0]) == 1 and frames[1] == EngineCoreRequestType.ABORT.value
        sent = msgspec.msgpack.decode(frames[2])
        assert sorted(sent) == sorted(r for r, e in owners.items() if e == 1)
        assert not any(r in c.request_book for r in owners)  # none is migrated later

    asyncio.run(main())


def test_send_scale_does_not_wait_for_an_engine_known_gone():
    """A rollback's ABORT to an engine declared dead must not hold the scale driver (and
    the recovery behind it) for the retry time."""

    async def main() -> None:
        c = fake_client(Topology.initial(3))
        c.input_socket.unreachable = {2}
        c.router.gone.add(2)
        missing = await asyncio.wait_for(
            c.send_scale([0, 2, 1], ScaleCommit("op", 1), retry_s=600), 60
        )
        assert missing == [2]
        assert [engine_id_of(f[0]) for f in c.input_socket.sent] == [0, 1]

    asyncio.run(main())


def test_sends_to_a_frozen_engine_never_block_the_frontend():
    """An engine that reads nothing (SIGSTOPped): 20,000 requests to it are queued, not
    a send that blocks the event loop (the default high-water marks block after about
    2,000, the liveness check that would kill that engine included)."""
    ctx = zmq.Context()
    router = engine_input_router(ctx)
    frozen = ctx.socket(zmq.DEALER)
    try:
        router.bind("tcp://127.0.0.1:0")
        frozen.setsockopt(zmq.IDENTITY, engine_identity(3))
        frozen.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))

        # Connected: a send stops raising EHOSTUNREACH (the peer's route exists).
        def routed() -> bool:
            try:
                router.send_multipart([engine_identity(3), b"ping"])
            except zmq.ZMQError:
                return False
            return True

        assert wait_until(routed, timeout_s=60)
        sent: list[int] = []

        def flood() -> None:
            for i in range(20_000):
                router.send_multipart([engine_identity(3), b"x" * 1024])
                sent.append(i)

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive() and len(sent) == 20_000
    finally:
        router.close(linger=0)
        frozen.close(linger=0)
        ctx.term()
