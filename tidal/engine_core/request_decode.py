"""Frames from the frontend's ROUTER, decoded for the engine's input queue.

A request the engine cannot decode must fail alone (docs/architecture.md#frontend-api: no input can take an
engine down), and under data parallelism it must still count for the wave, so an ADD that
does not decode becomes an ``UndecodableRequest`` instead of an exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from tidal.protocol.elastic import ScaleMessage
from tidal.protocol.messages import (
    EngineCoreRequest,
    EngineCoreRequestType,
    StartDPWave,
    UtilityRequest,
)

REQUEST_DECODERS = {
    EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
    EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(UtilityRequest),
    EngineCoreRequestType.SCALE: msgspec.msgpack.Decoder(ScaleMessage),
    # From the frontend only while the DP coordinator is being restarted (docs/architecture.md#faults).
    EngineCoreRequestType.START_DP_WAVE: msgspec.msgpack.Decoder(StartDPWave),
}
_ADD_FIELDS = EngineCoreRequest.__struct_fields__


@dataclass(frozen=True)
class UndecodableRequest:
    """An ADD whose payload did not decode (stays inside this process). It never reaches
    the scheduler; it is answered with an error when its id can be read, and under data
    parallelism it still counts as a request for the wave: the frontend may have woken
    the other ranks for it, and they would wait in a collective for this one."""

    request_id: str | None
    current_wave: int
    reason: str

    @classmethod
    def from_payload(cls, payload: bytes, error: Exception) -> UndecodableRequest:
        fields: Any = None
        try:
            fields = msgspec.msgpack.decode(payload)  # untyped: just find the id and wave
        except Exception:  # noqa: BLE001 - not even msgpack: nothing to answer
            pass
        if not isinstance(fields, list):
            fields = []
        rid = fields[0] if fields and isinstance(fields[0], str) else None
        i = _ADD_FIELDS.index("current_wave")
        wave = fields[i] if len(fields) > i and type(fields[i]) is int else 0
        return cls(rid, wave, f"the engine could not decode the request: {_named(error)}")


_PATH = re.compile(r"`\$((?:\[\d+\])+)`")


def _named(error: Exception) -> str:
    """msgspec's error with its array path (``$[2][3]``: requests are array_like) given
    as field names (``sampling_params.top_k``), so the message names the field."""

    def name(match: re.Match) -> str:
        t: Any = EngineCoreRequest
        parts = []
        for index in map(int, re.findall(r"\d+", match.group(1))):
            fields = (
                msgspec.structs.fields(t)
                if isinstance(t, type) and issubclass(t, msgspec.Struct)
                else ()
            )
            if index < len(fields):
                parts.append(fields[index].name)
                t = fields[index].type
            else:
                parts.append(f"[{index}]")
                t = None
        return "`" + ".".join(parts).replace(".[", "[") + "`"

    return _PATH.sub(name, str(error))


def decode_client_request(kind: bytes, payload: Any) -> tuple[EngineCoreRequestType, Any]:
    """One ``[request type byte, msgpack payload]`` message from the frontend (``payload``
    None when the frame is missing). An ADD that does not decode comes back as an
    ``UndecodableRequest``; any other bad message raises ``ValueError``."""
    try:
        req_type = EngineCoreRequestType(kind)
        return req_type, REQUEST_DECODERS[req_type].decode(payload)
    except Exception as e:  # noqa: BLE001 - whatever msgspec or the lookup raised
        if kind == EngineCoreRequestType.ADD.value and payload is not None:
            return EngineCoreRequestType.ADD, UndecodableRequest.from_payload(bytes(payload), e)
        raise ValueError(f"{type(e).__name__}: {e}") from e
