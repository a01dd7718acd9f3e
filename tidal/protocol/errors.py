"""Errors about another process: raised on one side of a socket because of the other.

They live in the bottom layer so that the engine (which raises ``EngineStartupError``)
and every frontend (which raises ``EngineDeadError`` to its callers) share one type each
without importing one another.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine process died or reported a fatal error; pending requests cannot finish."""


class EngineStartupError(RuntimeError):
    """An engine could not join the deployment: no reply to its handshake, a config that
    differs from the frontend's, an engine id outside the topology, a refused secret."""


class RequestFailedError(RuntimeError):
    """The engine refused or failed one request (``FinishReason.ERROR``); the engine and
    every other request go on. ``invalid``: refused as invalid input when it was admitted
    (the client's fault, HTTP 400); otherwise it failed while running (HTTP 500)."""

    def __init__(self, request_id: str, message: str, *, invalid: bool = False) -> None:
        super().__init__(message)
        self.request_id, self.message, self.invalid = request_id, message, invalid


class RankUnavailableError(EngineDeadError):
    """A request pinned to one rank (``data_parallel_rank``) that cannot take it: that
    rank's engine is dead and the deployment recovers without it. Only this request is
    refused (HTTP 503); the others, and requests without a pinned rank, are served."""
