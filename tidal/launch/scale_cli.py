"""``tidal scale --to N``: ask a running server to grow or shrink (``POST
/scale_elastic_ep``), wait for the operation to end and print its record as JSON.

Exit status: 0 when the server answered 200 (the record is printed on stdout), 1 when it
refused or the operation failed (the server's message on stderr, and the operation's
record on stdout when the answer has one), 2 for a bad flag (argparse; the message names
the flag). Standard library only: the command starts in well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from tidal.launch.api_key import add_api_key_arg, resolve_api_key

MAX_OPERATION_ID_CHARS = 256


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidal scale",
        description="grow or shrink a running elastic EP deployment (launch "
        "--enable-elastic-ep) to --to engine ranks; prints the operation's record",
    )
    p.add_argument("--to", type=int, required=True, metavar="N", help="new number of DP ranks")
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)"
    )
    add_api_key_arg(p, "the server's --api-key")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="scale-down: seconds the leaving ranks may finish their own requests before "
        "the rest migrate (default: 0, migrate at once)",
    )
    p.add_argument(
        "--operation-id",
        default=None,
        metavar="ID",
        help="idempotency key: repeating an id returns the first operation's record",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="seconds to wait for the operation to end (default: %(default)s)",
    )
    return p


def _check(p: argparse.ArgumentParser, ns: argparse.Namespace) -> str:
    """Flag errors (naming the flag) and the route's URL; ``ns.api_key`` resolved."""
    ns.api_key = resolve_api_key(p, ns)
    if ns.to < 1:
        p.error(f"--to: must be >= 1, got {ns.to}")
    if not (math.isfinite(ns.drain_timeout) and ns.drain_timeout >= 0):
        p.error(f"--drain-timeout: must be a finite number >= 0, got {ns.drain_timeout}")
    if not (math.isfinite(ns.timeout) and ns.timeout > 0):
        p.error(f"--timeout: must be a finite number > 0, got {ns.timeout}")
    if ns.operation_id is not None and not 0 < len(ns.operation_id) <= MAX_OPERATION_ID_CHARS:
        p.error(f"--operation-id: must be 1 to {MAX_OPERATION_ID_CHARS} characters")
    url = urllib.parse.urlsplit(ns.url)
    if url.scheme not in ("http", "https") or not url.netloc:
        p.error(f"--url: must be http://host:port or https://host:port, got {ns.url!r}")
    return ns.url.rstrip("/") + "/scale_elastic_ep"


def scale(
    url: str,
    new_size: int,
    *,
    api_key: str | None = None,
    drain_timeout: float = 0.0,
    operation_id: str | None = None,
    timeout: float = 3600.0,
) -> tuple[int, dict[str, Any]]:
    """POST the request; (HTTP status, JSON body). Raises OSError if the server cannot
    be reached or answers something that is not JSON."""
    body: dict[str, Any] = {"new_data_parallel_size": new_size, "drain_timeout": drain_timeout}
    if operation_id is not None:
        body["operation_id"] = operation_id
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        text = raw[:500].decode("utf-8", "replace")
        raise OSError(f"HTTP {status}, not a JSON answer: {text!r}") from None


def scale_main(argv: list[str]) -> int:
    p = make_parser()
    ns = p.parse_args(argv)
    url = _check(p, ns)
    try:
        status, body = scale(
            url,
            ns.to,
            api_key=ns.api_key,
            drain_timeout=ns.drain_timeout,
            operation_id=ns.operation_id,
            timeout=ns.timeout,
        )
    except (OSError, urllib.error.URLError) as e:
        reason = getattr(e, "reason", None) or e
        print(f"tidal scale: cannot reach {url}: {reason}", file=sys.stderr)
        return 1
    if status == 200:
        print(json.dumps(body, indent=2))
        return 0
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else json.dumps(body)
    if isinstance(body, dict) and isinstance(body.get("operation"), dict):
        print(json.dumps(body["operation"], indent=2))
    print(f"tidal scale: HTTP {status}: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(scale_main(sys.argv[1:]))
