"""The API key flag shared by ``launch`` and ``tidal scale``: ``--api-key``, defaulting to
``$TIDAL_API_KEY``. Standard library only (``tidal scale`` starts without torch).

An empty key is an error naming where it came from, never "no authentication": a
``TIDAL_API_KEY=""`` left by a script or a template must not silently open the server.
"""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "TIDAL_API_KEY"


def add_api_key_arg(parser: argparse.ArgumentParser, help_: str) -> None:
    # The environment is read after parsing (resolve_api_key): only then is it known
    # whether an empty value came from the flag or from the variable.
    parser.add_argument("--api-key", default=None, help=f"{help_} (default: ${API_KEY_ENV})")


def resolve_api_key(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str | None:
    """The key to use (None: none given), or a usage error naming the flag or variable
    that holds an empty one."""
    if ns.api_key is not None:
        if not ns.api_key.strip():
            parser.error("--api-key: must not be empty (leave the flag out for no API key)")
        return ns.api_key
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        parser.error(
            f"{API_KEY_ENV} is set but empty: set it to the key, or unset it for no API key"
        )
    return key
