"""A server on loopback answers only to its own names, so that a web page cannot drive it through DNS rebinding:
a request whose Host is another name is refused (400) at every door, with a message that says how to add a name
(`--allowed-hosts`). A server on 0.0.0.0 checks nothing unless names are given. Over the stand-in engine,
in-process.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import web
from cluster import ClusterSettings
from cluster.ingress import page_app
from tests._api_server import FakeEngine
from web.hosts import host_name

DOORS = [
    ("GET", "/"),
    ("GET", "/config"),
    ("POST", "/gradio_api/queue/join"),
    ("GET", "/sdapi/v1/options"),
    ("POST", "/v1/images/generations"),
]


@pytest.mark.parametrize(
    ("server_name", "extra", "names"),
    [
        ("127.0.0.1", (), {"127.0.0.1", "localhost", "::1"}),
        ("localhost", (), {"127.0.0.1", "localhost", "::1"}),
        ("::1", (), {"127.0.0.1", "localhost", "::1"}),
        ("127.0.0.2", ("sd.lan",), {"127.0.0.1", "127.0.0.2", "localhost", "::1", "sd.lan"}),
        ("0.0.0.0", ("sd.example.org",), {"127.0.0.1", "localhost", "::1", "sd.example.org"}),
    ],
)
def test_the_names_a_server_answers_to_follow_where_it_listens(server_name, extra, names):
    assert web.allowed_hosts(server_name, extra) == names


@pytest.mark.parametrize("server_name", ["0.0.0.0", "", "::", "192.168.1.5"])
def test_a_server_on_the_network_checks_no_names_unless_given(server_name):
    assert web.allowed_hosts(server_name) is None


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:7860", "127.0.0.1"),
        ("LocalHost:7860", "localhost"),
        ("[::1]:7860", "::1"),
        ("a.example.", "a.example"),
    ],
)
def test_the_name_is_read_from_the_host_header_without_its_port(header, name):
    assert host_name(header) == name


def test_allowed_hosts_are_names_comma_separated():
    assert web.read_allowed_hosts(" SD.Example.org, [::1],sd.lan ") == ("sd.example.org", "::1", "sd.lan")
    assert web.read_allowed_hosts(None) == ()
    for bad in ("sd.example.org:8080", "http://sd.example.org", "two words"):
        with pytest.raises(ValueError, match="is not a host name"):
            web.read_allowed_hosts(bad)


@pytest.fixture(scope="module")
def on_loopback():
    return web.build_app(FakeEngine(), allowed_hosts=web.allowed_hosts("127.0.0.1", ("sd.lan",)))


@pytest.mark.parametrize(("method", "path"), DOORS)
def test_a_request_naming_another_host_is_refused_at_every_door(on_loopback, method, path):
    client = TestClient(on_loopback, base_url="http://rebound.example:7860")
    answer = client.request(method, path, json={"prompt": "a cat"} if method == "POST" else None)
    assert answer.status_code == 400, answer.text
    assert "answers only to its own names (127.0.0.1, localhost, [::1], sd.lan)" in answer.text
    assert "--allowed-hosts" in answer.text and "rebound" not in answer.text


@pytest.mark.parametrize("host", ["127.0.0.1:7860", "localhost:8080", "[::1]:7860", "sd.lan"])
def test_the_servers_own_names_and_the_added_ones_are_served(on_loopback, host):
    answer = TestClient(on_loopback).get("/sdapi/v1/options", headers={"Host": host})
    assert answer.status_code == 200, answer.text


def test_a_websocket_naming_another_host_is_closed():
    from starlette.websockets import WebSocketDisconnect

    app = web.build_app(FakeEngine(), allowed_hosts=web.allowed_hosts("127.0.0.1"))
    with pytest.raises(WebSocketDisconnect) as closed:
        with TestClient(app, base_url="http://rebound.example").websocket_connect("/anything"):
            pass
    assert closed.value.code == 1008


def test_without_names_any_host_is_served():
    client = TestClient(web.build_app(FakeEngine()), base_url="http://anything.example")
    assert client.get("/sdapi/v1/options").status_code == 200


def test_the_command_line_checks_names_on_loopback_only(monkeypatch):
    import app

    seen = []
    pipe = FakeEngine()
    pipe.start_warmup = lambda num_images: None
    monkeypatch.setattr(app.engine, "enable_compile_cache", lambda path=None: None)
    monkeypatch.setattr(app.engine, "pair_cores", lambda dtype=None, int8=False: None)
    monkeypatch.setattr(app.engine, "load_pipeline", lambda source=None, **serving: pipe)
    monkeypatch.setattr(app.web, "build_app", lambda engine, **options: seen.append(options["allowed_hosts"]))
    monkeypatch.setattr(app.web, "serve", lambda web_app, **kwargs: None)
    monkeypatch.delenv("JAX_SD_ALLOWED_HOSTS", raising=False)
    app.main(["--host", "127.0.0.1"])
    app.main(["--host", "0.0.0.0"])
    app.main(["--host", "0.0.0.0", "--allowed-hosts", "sd.example.org"])
    app.main(["--host", "127.0.0.1", "--share"])  # the share link's tunnel comes under the link's name
    assert seen == [
        {"127.0.0.1", "localhost", "::1"},
        None,
        {"127.0.0.1", "localhost", "::1", "sd.example.org"},
        None,
    ]
    with pytest.raises(SystemExit):
        app.main(["--allowed-hosts", "sd.example.org:8080"])


def test_the_clusters_page_checks_the_names_its_settings_give():
    settings = ClusterSettings.from_args({"allowed_hosts": ["localhost", "sd.example.org"]})
    assert settings.allowed_hosts == ("localhost", "sd.example.org")
    app = page_app(FakeEngine(), settings)
    assert TestClient(app, base_url="http://rebound.example").get("/sdapi/v1/options").status_code == 400
    assert TestClient(app, base_url="http://sd.example.org").get("/sdapi/v1/options").status_code == 200
    assert web.allowed_hosts("0.0.0.0", ClusterSettings().allowed_hosts) is None  # none given: none checked
    with pytest.raises(ValueError, match="is not a host name"):
        ClusterSettings.from_args({"allowed_hosts": "sd.example.org:80"})
