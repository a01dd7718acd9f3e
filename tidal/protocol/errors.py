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
