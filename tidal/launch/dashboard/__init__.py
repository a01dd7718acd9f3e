"""The load-balance stats page: static files served by the API server at /dashboard."""

from __future__ import annotations

from importlib import resources


def dashboard_html() -> str:
    return resources.files(__name__).joinpath("index.html").read_text(encoding="utf-8")
