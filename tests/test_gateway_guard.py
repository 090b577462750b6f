"""Cross-site protection of the HTTP gateway (gateway/origins.py), over real HTTP against a daemon:
JSON-only bodies, a Host allow-list on a loopback listener, the Origin check, CORS only when configured."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon
from tests.test_gateway import start_gateway

BODY = {"prompt": "Hello", "max_tokens": 2}
APP = "http://app.example:3000"
EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    """A gateway as the default config has it: on 127.0.0.1, no key, no CORS."""
    d, url = start_gateway(tmp_path_factory.mktemp("plain"), model_path, workers={"cpu_workers": 1})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture(scope="module")
def cors(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    """A gateway on 127.0.0.1 that lets one web origin in, and answers to one more host name."""
    d, url = start_gateway(tmp_path_factory.mktemp("cors"), model_path, workers={"cpu_workers": 1},
                           http={"cors_origins": [APP], "allowed_hosts": ["llm.internal", "*.lan.example"]})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


def post(url: str, path: str = "/v1/completions", body: Any = None, **headers: str) -> httpx.Response:
    content = httpx.Request("POST", "http://x", json=BODY if body is None else body).content
    return httpx.post(url + path, content=content, headers=headers, timeout=30)


def error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error", err
    return str(err["message"])


def test_the_issues_cross_site_post_is_refused(plain: tuple[Daemon, str]) -> None:
    """What any web page could send to a gateway on localhost: a form-like POST from its own origin,
    through its own (rebound) name. Before: 200 and a completion."""
    r = post(plain[1], **{"content-type": "text/plain", "origin": EVIL, "host": "evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "text/plain; charset=utf-8"])
def test_a_body_that_is_not_json_is_415(plain: tuple[Daemon, str], ctype: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        msg = error(post(plain[1], path, **{"content-type": ctype}), 415, "unsupported_media_type")
        assert repr(ctype) in msg and "application/json" in msg
    r = post(plain[1], "/v1/messages", **{"content-type": ctype})  # Anthropic's shape there
    assert r.status_code == 415 and r.json()["type"] == "error" and "application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                   "application/vnd.api+json", None])
def test_json_bodies_are_served(plain: tuple[Daemon, str], ctype: str | None) -> None:
    headers = {} if ctype is None else {"content-type": ctype}  # none at all: requests.post(data=...) sends none
    r = post(plain[1], **headers)
    assert r.status_code == 200 and r.json()["choices"], r.text
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "192.168.1.7", "localhost.evil.example",
                                  "llm.internal"])
def test_on_loopback_only_localhost_names_are_answered(plain: tuple[Daemon, str], host: str) -> None:
    url = plain[1]
    msg = error(httpx.get(url + "/v1/models", headers={"host": host}), 403, "host_not_allowed")
    assert "allowed_hosts" in msg
    error(post(url, host=host), 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "127.0.0.1", "127.0.0.2", "[::1]", "app.localhost"])
def test_localhost_names_are_answered(plain: tuple[Daemon, str], host: str) -> None:
    port = plain[1].rsplit(":", 1)[1]
    for h in (host, f"{host}:{port}"):
        assert httpx.get(plain[1] + "/v1/models", headers={"host": h}).status_code == 200


def test_a_foreign_origin_is_403_on_every_route(plain: tuple[Daemon, str]) -> None:
    url = plain[1]
    for origin in (EVIL, "null", "http://localhost:3000", "http://127.0.0.1:" + url.rsplit(":", 1)[1]):
        msg = error(post(url, origin=origin), 403, "origin_not_allowed")
        assert "cors_origins" in msg and origin in msg
        error(httpx.get(url + "/v1/models", headers={"origin": origin}), 403, "origin_not_allowed")
        error(httpx.get(url + "/health", headers={"origin": origin}), 403, "origin_not_allowed")
    r = post(url, "/v1/messages", {"model": "x", "max_tokens": 2, "messages": []}, origin=EVIL)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


def test_cors_is_off_unless_configured(plain: tuple[Daemon, str]) -> None:
    r = httpx.options(plain[1] + "/v1/chat/completions", headers={
        "origin": APP, "access-control-request-method": "POST", "access-control-request-headers": "content-type"})
    assert r.status_code == 403 and not any(h.startswith("access-control-") for h in r.headers)


def test_configured_origins_get_cors(cors: tuple[Daemon, str]) -> None:
    """A preflight from a listed origin is answered (it was a 405), and its requests carry the header."""
    url = cors[1]
    r = httpx.options(url + "/v1/chat/completions", headers={
        "origin": APP, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os"})
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == APP and "Origin" in r.headers["vary"]
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    r = post(url, origin=APP)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP and r.json()["choices"]
    r = httpx.get(url + "/v1/models", headers={"origin": APP + "/"})  # the same origin, written with a slash
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP + "/"
    # another origin gets neither the preflight nor the request
    r = httpx.options(url + "/v1/chat/completions", headers={"origin": EVIL, "access-control-request-method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    error(post(url, origin="http://app.example:3001"), 403, "origin_not_allowed")
    # an OPTIONS that is not a preflight is still a 405
    assert httpx.options(url + "/v1/completions").status_code == 405
    # and the content type is checked for the allowed origin too
    error(post(url, origin=APP, **{"content-type": "text/plain"}), 415, "unsupported_media_type")


def test_allowed_hosts_add_names(cors: tuple[Daemon, str]) -> None:
    url = cors[1]
    for host in ("llm.internal", "llm.internal:443", "a.lan.example", "localhost"):
        assert httpx.get(url + "/v1/models", headers={"host": host}).status_code == 200, host
    for host in ("lan.example.evil", "evil.example", "xllm.internal"):
        error(httpx.get(url + "/v1/models", headers={"host": host}), 403, "host_not_allowed")


def test_bad_settings_are_refused() -> None:
    from llamapool.config import ConfigError, from_dict

    ok = from_dict({"model": {"path": "m"}, "http": {"cors_origins": ["http://[::1]:3000", "https://a.example", "*"],
                             "allowed_hosts": ["*.lan", "h", "[::1]", "*"]}})
    assert ok.http is not None and ok.http.cors_origins == ("http://[::1]:3000", "https://a.example", "*")
    for key, value, words in (("cors_origins", ["http://a.example/path"], "no path"),
                              ("cors_origins", "http://a.example", "list of non-empty strings"),
                              ("allowed_hosts", ["http://h"], "no scheme"),
                              ("allowed_hosts", [""], "non-empty")):
        with pytest.raises(ConfigError, match=f"http.{key}: .*{words}"):
            from_dict({"model": {"path": "m"}, "http": {key: value}})
