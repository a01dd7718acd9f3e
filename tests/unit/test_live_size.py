"""The live DP size is the topology's (docs/architecture.md#elastic-identity): which engines run the DP machinery,
what the frontend hands each engine, and how an engine reads its rank (no processes)."""

from __future__ import annotations

import msgspec
import pytest

from tidal.config import ParallelConfig
from tidal.engine_core.dp_proc import DPEngineCoreProc
from tidal.engine_core.entry import engine_proc_class
from tidal.engine_core.proc import EngineCoreProc
from tidal.engine_core.request_decode import UndecodableRequest, decode_client_request
from tidal.frontend.dp_state import DPFrontendState
from tidal.frontend.launchers.proc_manager import frontend_addresses
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.messages import (
    EngineAddresses,
    EngineCoreRequest,
    EngineCoreRequestType,
    encode,
)
from tidal.protocol.topology import Topology
from tidal.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("dp", "elastic", "expected"),
    [(1, False, False), (1, True, True), (2, False, True), (3, True, True)],
)
def test_dp_machinery_runs_above_one_rank_or_with_elastic_ep(dp, elastic, expected):
    assert ParallelConfig(data_parallel_size=dp, enable_elastic_ep=elastic).is_data_parallel is (
        expected
    )


def test_elastic_ep_flag_reaches_the_engine_class_and_addresses(qwen3_ckpt, tmp_path):
    plain = EngineArgs(model=qwen3_ckpt).create_engine_config()
    elastic = EngineArgs(model=qwen3_ckpt, enable_elastic_ep=True).create_engine_config()
    assert elastic.parallel.enable_elastic_ep and elastic.parallel.data_parallel_size == 1
    assert engine_proc_class(plain) is EngineCoreProc
    assert engine_proc_class(elastic) is DPEngineCoreProc
    # The coordinator's sockets exist for an elastic deployment of one engine.
    assert frontend_addresses(plain, str(tmp_path)).coordinator is None
    assert frontend_addresses(elastic, str(tmp_path)).coordinator is not None
    # Whether the DP machinery runs must match on every engine: it is in the hash.
    assert plain.config_hash() != elastic.config_hash()


def test_handshake_reply_carries_the_topology():
    top = Topology.initial(3, store_address="127.0.0.1:1234")
    reply = EngineAddresses("ipc://a", "ipc://b", None, None, "h", top)
    back = msgspec.msgpack.decode(encode(reply), type=EngineAddresses)
    assert back.topology == top and back.topology.rank_of(2) == 2
    assert (
        msgspec.msgpack.decode(encode(EngineAddresses("a", "b")), type=EngineAddresses).topology
        is None
    )


def test_frontend_routes_over_the_topology_not_the_launch_size():
    # Engines 4 and 7 (ids are not ranks): an explicit rank maps to the engine at that
    # position, and the wave state starts at the topology's epoch.
    top = Topology(2, [4, 7], next_id=8)
    dp = DPFrontendState(top, "tidal")
    assert dp.topology is top and dp.wave.epoch == 2
    req = EngineCoreRequest("r", [1, 2], SamplingParams(), data_parallel_rank=1)
    engine, wake = dp.route(req)
    assert engine == 7 and wake is not None and wake.engine_id == 7
    with pytest.raises(ValueError, match="out of range"):
        dp.route(EngineCoreRequest("s", [1], SamplingParams(), data_parallel_rank=2))


def test_undecodable_add_fails_alone_and_other_garbage_is_dropped():
    kind, bad = decode_client_request(EngineCoreRequestType.ADD.value, encode(["r1", "x"]))
    assert kind is EngineCoreRequestType.ADD and isinstance(bad, UndecodableRequest)
    assert bad.request_id == "r1" and "could not decode" in bad.reason
    good = EngineCoreRequest("r2", [3], SamplingParams())
    assert decode_client_request(EngineCoreRequestType.ADD.value, encode(good)) == (
        EngineCoreRequestType.ADD,
        good,
    )
    for kind, payload in ((b"\x7f", b""), (EngineCoreRequestType.ABORT.value, b"\xc1")):
        with pytest.raises(ValueError):
            decode_client_request(kind, payload)
    with pytest.raises(ValueError):
        decode_client_request(EngineCoreRequestType.ADD.value, None)  # no payload frame
