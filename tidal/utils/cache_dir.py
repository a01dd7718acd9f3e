"""Where Tidal keeps what it caches across runs (the embedded default model, the measured
CPU kernel choices, inductor's folder): ``$XDG_CACHE_HOME/tidal``, else ``~/.cache/tidal``."""

from __future__ import annotations

import os


def cache_root() -> str:
    """``$XDG_CACHE_HOME/tidal`` or ``~/.cache/tidal`` (read now: tests move it)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tidal")
