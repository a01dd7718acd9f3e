"""A request pinned (``data_parallel_rank``) to a rank whose engine is dead gets a clear
503 (code ``rank_unavailable``) -- streaming or not, before any response starts -- never
a 500 with a socket error; the server keeps serving the others (docs/architecture.md#faults)."""

from __future__ import annotations

from tests.unit.test_api_server import FakeAsyncLLM, assert_error, client_for, ok_completion, run
from tidal.launch.errors import classify_error
from tidal.protocol.errors import RankUnavailableError

DEAD_RANK = 1


class RecoveringEngine(FakeAsyncLLM):
    """Rank 1's engine is dead; the deployment recovers without it."""

    def check_data_parallel_rank(self, rank: int | None) -> None:
        if rank == DEAD_RANK:
            raise RankUnavailableError(f"data_parallel_rank {rank}: its engine (1) is dead")


@run
async def test_a_request_pinned_to_a_dead_rank_is_a_503():
    async with client_for(RecoveringEngine()) as c:
        for stream in (False, True):
            body = {"prompt": "hi", "max_tokens": 2, "stream": stream, "data_parallel_rank": 1}
            err = assert_error(await c.post("/v1/completions", json=body), 503)
            assert err["code"] == "rank_unavailable" and err["param"] == "data_parallel_rank"
            assert "dead" in err["message"]
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
            r = await c.post("/v1/chat/completions", json={**chat, "data_parallel_rank": 1})
            assert assert_error(r, 503)["code"] == "rank_unavailable"
        assert c.engine.calls == []  # refused before reaching the engine
        await ok_completion(c)  # the server serves the others
        body = {"prompt": "hi", "max_tokens": 2, "data_parallel_rank": 0}
        assert (await c.post("/v1/completions", json=body)).status_code == 200


def test_rank_unavailable_is_a_503_only_while_the_deployment_lives():
    alive = FakeAsyncLLM()
    err = classify_error(RankUnavailableError("data_parallel_rank 1: dead"), alive)
    assert (err.status, err.code, err.param) == (503, "rank_unavailable", "data_parallel_rank")
    alive.dead = True  # nothing serves at all: the deployment's own error
    assert classify_error(RankUnavailableError("x"), alive).code == "engine_dead"
