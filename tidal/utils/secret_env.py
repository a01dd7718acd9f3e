"""The environment variables that hold secrets, and the environment a child gets without
them.

``TIDAL_API_KEY`` (the HTTP API key) and ``TIDAL_DP_AUTH_KEY`` (the DP control plane's
key) are read by the command line only; the processes it starts get what they need in
their launch payload. A child's environment is readable by any process of the same user
(``/proc/<pid>/environ``) and is passed on to whatever that child runs in turn (the
chat-template sandbox renders templates a client sent), so no child inherits them.
Standard library only: ``tidal scale`` reads the API key without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping

API_KEY_ENV = "TIDAL_API_KEY"
AUTH_KEY_ENV = "TIDAL_DP_AUTH_KEY"
SECRET_ENV_VARS = (API_KEY_ENV, AUTH_KEY_ENV)


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` for a child process: the secret variables left out."""
    return {k: v for k, v in environ.items() if k not in SECRET_ENV_VARS}
