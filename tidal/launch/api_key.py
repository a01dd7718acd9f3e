"""The API key flags shared by ``launch`` and ``tidal scale``: ``--api-key``,
``--api-key-file``, defaulting to ``$TIDAL_API_KEY``. Standard library only (``tidal
scale`` starts without torch).

A key on the command line shows in every user's ``ps``; the file (or the variable) keeps
it out. An empty key is an error naming where it came from, never "no authentication": a
``TIDAL_API_KEY=""`` left by a script or a template must not silently open the server.
"""

from __future__ import annotations

import argparse
import os

from tidal.utils.secret_env import API_KEY_ENV

__all__ = ["API_KEY_ENV", "add_api_key_arg", "read_secret_file", "resolve_api_key"]


def add_api_key_arg(parser: argparse.ArgumentParser, help_: str) -> None:
    # The environment is read after parsing (resolve_api_key): only then is it known
    # whether an empty value came from the flag or from the variable.
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"{help_} (default: ${API_KEY_ENV}); visible in ps, prefer --api-key-file",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (its first line), which keeps it out of the "
        "process list; instead of --api-key",
    )


def read_secret_file(parser: argparse.ArgumentParser, flag: str, path: str) -> str:
    """The secret in ``path``: its first line without surrounding whitespace (a trailing
    newline is how editors and ``echo`` end a file), or a usage error naming ``flag``."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}")
    if not key:
        parser.error(f"{flag}: {path} is empty (its first line must hold the key)")
    return key


def resolve_api_key(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str | None:
    """The key to use (None: none given), or a usage error naming the flag or variable
    that holds an empty one."""
    if ns.api_key is not None and ns.api_key_file is not None:
        parser.error("--api-key-file: give either --api-key or --api-key-file, not both")
    if ns.api_key_file is not None:
        return read_secret_file(parser, "--api-key-file", ns.api_key_file)
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
