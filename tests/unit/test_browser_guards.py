"""What a web page the operator opens can do to a server (issue 23), against a fake engine:
JSON routes take only ``application/json`` (415 otherwise, before a byte is read or the
engine is asked anything), a server bound to loopback answers only loopback ``Host``
names (DNS rebinding), ``--allowed-hosts`` widens or sets that list, and CORS headers
appear only for ``--allowed-origins``. Also: an empty API key is refused where it is
given (``build_app``, ``launch``)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.unit.test_api_server import CHAT, assert_error, client_for, ok_completion, run
from tests.unit.test_scale_api import ScalingFakeLLM
from tidal.launch.api_server import build_app
from tidal.launch.cli import main
from tidal.launch.hosts import allowed_host_names, host_name, is_loopback

JSON_ROUTES = {
    "/v1/completions": {"prompt": "hi there", "max_tokens": 2},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
    "/scale_elastic_ep": {"new_data_parallel_size": 3},
}
REFUSED_TYPES = [
    "text/plain",  # what a page may POST without a preflight
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    None,
    "application/json; charset=latin-1",
    "application/json-patch+json",
    "text/json",
]
ACCEPTED_TYPES = [
    "application/json",
    "Application/JSON; charset=UTF-8",
    'application/json;charset="utf-8"',
]


@pytest.mark.parametrize(
    ("content_type", "status"),
    [(t, 415) for t in REFUSED_TYPES] + [(t, 200) for t in ACCEPTED_TYPES],
)
@run
async def test_json_routes_take_application_json_only(content_type, status):
    engine = ScalingFakeLLM(2)
    async with client_for(engine) as c:
        for path, body in JSON_ROUTES.items():
            headers = {"content-type": content_type} if content_type else {}
            r = await c.post(path, content=json.dumps(body), headers=headers)
            assert r.status_code == status, (path, r.text)
            if status == 415:
                err = assert_error(r, 415)
                assert err["code"] == "unsupported_media_type"
                assert "application/json" in err["message"]
        if status == 415:  # nothing ran, nothing scaled
            assert engine.calls == [] and engine.scale_calls == []
            await ok_completion(c)
        else:
            assert engine.scale_calls == [(3, 0.0, None)]


# ---- Host -------------------------------------------------------------------------------------


def test_host_header_parsing_and_policy():
    assert [host_name(h) for h in ("LocalHost:8000", "[::1]:80", "[::1]", "10.0.0.1")] == [
        "localhost",
        "::1",
        "::1",
        "10.0.0.1",
    ]
    for bad in ("::1", "a:b:c", "evil.com:x", "[::1]junk", ":80"):
        assert host_name(bad) is None, bad
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.8.9.10") and not is_loopback("0.0.0.0") and not is_loopback("::")
    assert allowed_host_names("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert "127.0.0.2" in allowed_host_names("127.0.0.2")
    assert allowed_host_names("0.0.0.0") is None  # bound to the network: any Host
    assert allowed_host_names("0.0.0.0", ["Api.Example.com"]) == {"api.example.com"}
    assert allowed_host_names("::1", ["proxy.local"]) == {
        "localhost",
        "127.0.0.1",
        "::1",
        "proxy.local",
    }
    assert allowed_host_names("127.0.0.1", ["*"]) is None


async def _status(app, host: str | None, path: str = "/v1/models") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
        headers = {"host": host} if host is not None else {}
        return await c.get(path, headers=headers)


LOOPBACK_HOSTS = ["127.0.0.1:8000", "localhost:8000", "localhost", "[::1]:8000", "127.0.0.1"]
FOREIGN_HOSTS = ["evil.example:8000", "evil.example", "127.0.0.1.nip.io:8000", "[::1]x", "10.1.2.3"]


@run
async def test_loopback_server_refuses_foreign_host_headers():
    engine = ScalingFakeLLM(2)
    app = build_app(engine, bind_host="127.0.0.1", shutdown_engine=False)
    for host in LOOPBACK_HOSTS:
        assert (await _status(app, host)).status_code == 200, host
    for host in FOREIGN_HOSTS:
        for path in ("/v1/models", "/stats", "/health", "/dashboard"):
            r = await _status(app, host, path)
            err = assert_error(r, 400)
            assert err["code"] == "invalid_host" and "--allowed-hosts" in err["message"], host
    # A foreign Host cannot scale either, whatever its body.
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://evil.example:8000") as c:
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        assert_error(r, 400)
    assert engine.scale_calls == []


@run
async def test_allowed_hosts_and_servers_bound_elsewhere():
    engine = ScalingFakeLLM(2)
    anywhere = build_app(engine, bind_host="0.0.0.0", shutdown_engine=False)
    for host in [*LOOPBACK_HOSTS, "evil.example:8000", "10.1.2.3"]:
        assert (await _status(anywhere, host)).status_code == 200, host
    listed = build_app(
        engine, bind_host="0.0.0.0", allowed_hosts=["api.example.com"], shutdown_engine=False
    )
    assert (await _status(listed, "api.example.com:443")).status_code == 200
    assert_error(await _status(listed, "other.example.com"), 400)
    assert_error(await _status(listed, "127.0.0.1:8000"), 400)  # only the list, when given
    proxied = build_app(
        engine, bind_host="127.0.0.1", allowed_hosts=["proxy.local"], shutdown_engine=False
    )
    for host in ("proxy.local", "localhost:8000"):
        assert (await _status(proxied, host)).status_code == 200, host
    assert_error(await _status(proxied, "evil.example"), 400)


# ---- CORS -------------------------------------------------------------------------------------


async def _cors(app, origin: str) -> tuple[httpx.Response, httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
        preflight = await c.options(
            "/v1/completions",
            headers={
                "origin": origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type, authorization",
            },
        )
        read = await c.get("/v1/models", headers={"origin": origin})
    return preflight, read


@run
async def test_no_cors_headers_unless_origins_are_allowed():
    engine = ScalingFakeLLM(2)
    app = build_app(engine, bind_host="127.0.0.1", shutdown_engine=False)
    preflight, read = await _cors(app, "http://evil.example")
    assert preflight.status_code >= 400  # no route answers OPTIONS: the preflight fails
    for r in (preflight, read):
        assert not [h for h in r.headers if h.startswith("access-control-")], r.headers

    app = build_app(
        engine, bind_host="127.0.0.1", allowed_origins=["http://ui.example"], shutdown_engine=False
    )
    preflight, read = await _cors(app, "http://ui.example")
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert read.headers["access-control-allow-origin"] == "http://ui.example"
    preflight, read = await _cors(app, "http://evil.example")
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in read.headers


# ---- empty API keys -----------------------------------------------------------------------------


def test_build_app_refuses_an_empty_api_key():
    with pytest.raises(ValueError, match="api_key must not be empty"):
        build_app(ScalingFakeLLM(2), api_key="", shutdown_engine=False)


@pytest.mark.parametrize(
    ("args", "env_key", "named"),
    [
        (["--api-key", ""], None, "--api-key: must not be empty"),
        (["--api-key", "  "], "good-key", "--api-key: must not be empty"),
        ([], "", "TIDAL_API_KEY is set but empty"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "scale"])
def test_an_empty_api_key_is_an_error_naming_its_source(
    command, args, env_key, named, monkeypatch, capsys
):
    monkeypatch.delenv("TIDAL_API_KEY", raising=False)
    if env_key is not None:
        monkeypatch.setenv("TIDAL_API_KEY", env_key)
    extra = ["--to", "2"] if command == "scale" else ["--model", "/nonexistent"]
    with pytest.raises(SystemExit) as e:
        main([command, *extra, *args])
    assert e.value.code == 2
    assert named in capsys.readouterr().err
