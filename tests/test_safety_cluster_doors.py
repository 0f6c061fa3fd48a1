"""The cluster's page has the doors of `python app.py`: its settings take `auth`, `api_keys`, `max_body_mb`,
`max_picture_pixels` and `mcp` with the flags' meanings, refuse what the flags refuse, and reach the same
`web.build_app`, so that the page, both REST APIs and MCP are closed alike. Each caller's share is the single
machine's too: `max_caller_requests`, `max_caller_work` and the proxies `forwarded_allow_ips` names.

The page's app is built as the ingress builds it (`cluster.ingress.page_app`), over the stand-in engine and
in-process: no Ray is started here.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from fastapi.testclient import TestClient

import web
from cluster import ClusterSettings
from cluster.ingress import page_app
from tests._api_server import FakeEngine

USER = ("ann", "secret-a")
KEY = "sk-cluster-key-1"
BODY = {"prompt": "a cat", "steps": 2, "width": 64, "height": 64}


# ---- the settings --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "auth", "keys"),
    [
        ({"auth": "ann:secret-a"}, (USER,), ()),
        ({"auth": "ann:secret-a, bob:pa:ss"}, (USER, ("bob", "pa:ss")), ()),
        ({"auth": ["ann:secret-a", "bob:hunter22"]}, (USER, ("bob", "hunter22")), ()),
        ({"api_keys": KEY}, (), (KEY,)),
        ({"api_keys": [KEY, "sk-cluster-key-2"]}, (), (KEY, "sk-cluster-key-2")),
        ({"auth": None, "api_keys": None}, (), ()),
    ],
)
def test_auth_and_api_keys_are_read_as_app_pys_flags_read_them(args, auth, keys):
    settings = ClusterSettings.from_args(args)
    assert settings.auth == auth and settings.api_keys == keys


def test_auth_and_api_keys_may_live_in_files_that_the_config_names(tmp_path):
    (tmp_path / "users").write_text("# invited\nann:secret-a\n")
    (tmp_path / "keys").write_text(f"{KEY}\n")
    settings = ClusterSettings.from_args({"auth": str(tmp_path / "users"), "api_keys": f"@{tmp_path / 'keys'}"})
    assert settings.auth == (USER,) and settings.api_keys == (KEY,)


def test_the_secrets_stay_out_of_the_settings_repr():
    settings = ClusterSettings.from_args({"auth": "ann:secret-a", "api_keys": KEY})
    assert "secret-a" not in repr(settings) and KEY not in repr(settings)


def test_the_body_limit_and_picture_cap_default_to_the_single_machines():
    settings = ClusterSettings()
    assert settings.max_body_mb == web.DEFAULT_MAX_BODY_MB
    assert settings.max_picture_pixels is None and settings.mcp is False and not settings.auth
    options = ClusterSettings.from_args({"max_body_mb": 5, "max_picture_pixels": 4_000_000, "mcp": True})
    assert (options.max_body_mb, options.max_picture_pixels, options.mcp) == (5, 4_000_000, True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"auth": "nobody"}, "'nobody' is not user:password"),
        ({"auth": ""}, "auth: nothing given"),
        ({"auth": {"ann": "secret-a"}}, "auth must be a string or a list of strings"),
        ({"api_keys": "short"}, "at least 8 characters"),
        ({"api_keys": [KEY, 12345678]}, "api_keys must be a string or a list of strings"),
        ({"max_body_mb": 0}, "max_body_mb must be a number above 0"),
        ({"max_body_mb": "ten"}, "max_body_mb must be a number above 0"),
        ({"max_picture_pixels": -1}, "max_picture_pixels must be a whole number above 0"),
        ({"mcp": "yes"}, "mcp must be true or false"),
        ({"max_caller_requests": 0}, "max_caller_requests must be a whole number of at least 1"),
        ({"max_caller_requests": "8"}, "max_caller_requests must be a whole number of at least 1"),
        ({"max_caller_work": 2.5}, "max_caller_work must be a whole number of at least 1"),
        ({"max_caller_work": True}, "max_caller_work must be a whole number of at least 1"),
        ({"forwarded_allow_ips": "10.0.0.1,proxy.example"}, "'proxy.example' is not an address or a network"),
        ({"forwarded_allow_ips": ["10.0.0.1", 10]}, "forwarded_allow_ips must be a string or a list of strings"),
        ({"forwarded_allow_ips": {"proxy": "10.0.0.1"}}, "forwarded_allow_ips must be a string or a list of strings"),
        ({"api_key": KEY}, "unknown settings \\['api_key'\\]"),
    ],
)
def test_a_bad_door_setting_is_refused_with_what_is_wrong(args, message):
    with pytest.raises(ValueError, match=message):
        ClusterSettings.from_args(args)


def test_each_callers_share_defaults_to_the_single_machines_and_trusts_no_proxy():
    settings = ClusterSettings()
    assert (settings.max_caller_requests, settings.max_caller_work) == (web.DEFAULT_MAX_REQUESTS, web.DEFAULT_MAX_WORK)
    assert (
        settings.forwarded_allow_ips
        == ()
        == ClusterSettings.from_args({"forwarded_allow_ips": None}).forwarded_allow_ips
    )


@pytest.mark.parametrize(
    ("value", "proxies"),
    [
        ("10.0.0.0/8", ("10.0.0.0/8",)),
        ("10.0.0.0/8, 192.0.2.7", ("10.0.0.0/8", "192.0.2.7")),  # as --forwarded-allow-ips takes them
        (["10.0.0.0/8", "192.0.2.7,2001:db8::1"], ("10.0.0.0/8", "192.0.2.7", "2001:db8::1")),
        ("*", ("*",)),
        ([], ()),
    ],
)
def test_the_trusted_proxies_are_read_as_the_flag_reads_them(value, proxies):
    assert ClusterSettings.from_args({"forwarded_allow_ips": value}).forwarded_allow_ips == proxies


def test_the_callers_share_reaches_the_page():
    settings = ClusterSettings.from_args({"max_caller_requests": 3, "max_caller_work": 500})
    limits = page_app(FakeEngine(), settings).state.api_jobs.limits
    assert (limits.max_requests, limits.max_work) == (3, 500)


# ---- the page the ingress builds -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def closed():
    settings = ClusterSettings.from_args({"auth": "ann:secret-a", "api_keys": KEY, "mcp": True, "max_body_mb": 1})
    with TestClient(page_app(FakeEngine(), settings)) as client:
        yield client


ROUTES = [
    ("GET", "/config"),  # the page
    ("GET", "/gradio_api/info"),
    ("POST", "/gradio_api/queue/join"),
    ("POST", "/gradio_api/upload"),
    ("POST", "/sdapi/v1/txt2img"),  # A1111's API
    ("GET", "/sdapi/v1/options"),
    ("POST", "/v1/images/generations"),  # OpenAI's
    ("GET", "/gradio_api/mcp/schema"),  # MCP
    ("POST", "/gradio_api/mcp/"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_of_the_cluster_page_is_closed_to_strangers(closed, method, path):
    stranger = TestClient(closed.app, client=(f"192.0.2.{ROUTES.index((method, path)) + 1}", 50000))
    for auth in (None, ("ann", "wrong"), ("eve", "secret-a")):  # from an address of its own: no lockout
        answer = stranger.request(method, path, auth=auth, json=BODY if method == "POST" else None)
        assert answer.status_code == 401, (path, auth, answer.status_code, answer.text[:200])


def test_the_cluster_page_serves_its_users_and_keys(closed):
    closed.cookies.clear()
    assert closed.post("/login", data={"username": "ann", "password": "wrong"}).status_code == 400
    assert closed.post("/login", data={"username": "ann", "password": "secret-a"}).status_code == 200
    assert closed.get("/config").status_code == 200
    closed.cookies.clear()
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert closed.post("/sdapi/v1/txt2img", json=BODY, auth=USER).status_code == 200
    assert (
        closed.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"}, headers=bearer).status_code
        == 200
    )
    assert closed.get("/gradio_api/mcp/schema", headers=bearer).status_code == 200


def test_the_cluster_pages_body_limit_is_its_setting(closed):
    big = {"prompt": "a cat", "init_images": ["A" * (2 * 2**20)]}
    answer = closed.post("/sdapi/v1/img2img", json=big, auth=USER)
    assert answer.status_code == 413 and "1 MB" in answer.json()["detail"]
    assert closed.app.state.demo.max_file_size == 2**20  # the page's uploads, as on the single machine


# ---- behind a proxy -----------------------------------------------------------------------------------------

PROXY = "10.0.0.5"  # the operator's, inside the network the settings name
STRANGER = "198.51.100.1"  # anyone else, claiming to forward for someone
WAIT_S = 20


@pytest.fixture
def proxied():
    pipe = FakeEngine()
    settings = ClusterSettings.from_args({"forwarded_allow_ips": "10.0.0.0/8", "max_caller_requests": 1})
    with TestClient(page_app(pipe, settings)) as client:
        yield pipe, client


def from_address(client: TestClient, address: str) -> TestClient:
    return TestClient(client.app, client=(address, 50000))


def test_a_cluster_page_reads_x_forwarded_for_from_its_proxy_only(proxied):
    pipe, client = proxied
    for address, caller in ((PROXY, "address 203.0.113.7"), (STRANGER, f"address {STRANGER}")):
        answer = from_address(client, address).post(
            "/sdapi/v1/txt2img", json=BODY, headers={"X-Forwarded-For": "203.0.113.7"}
        )
        assert answer.status_code == 200 and pipe.tickets[-1].caller == caller


def test_behind_its_proxy_a_cluster_page_holds_each_client_to_its_share(proxied):
    pipe, client = proxied
    pipe.hold = True
    post = from_address(client, PROXY).post
    ann, bob = ({"X-Forwarded-For": address} for address in ("203.0.113.7", "203.0.113.8"))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        try:
            waiting = pool.submit(post, "/sdapi/v1/txt2img", json=BODY, headers=ann)
            wait_for(lambda: len(pipe.tickets) == 1)
            refused = pool.submit(post, "/sdapi/v1/txt2img", json=BODY, headers=ann).result(WAIT_S)
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0
            assert "busy with your requests" in refused.json()["detail"]
            other = pool.submit(post, "/sdapi/v1/txt2img", json=BODY, headers=bob)  # another client: its own share
            wait_for(lambda: len(pipe.tickets) == 2)
            assert [ticket.caller for ticket in pipe.tickets] == ["address 203.0.113.7", "address 203.0.113.8"]
        finally:  # nothing left held, whatever failed: the pool's threads end
            pipe.hold = False
            for ticket in pipe.tickets:
                ticket.cancel()
        assert waiting.result(WAIT_S).status_code == other.result(WAIT_S).status_code == 200  # A1111's "interrupted"


def wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s"
        time.sleep(0.02)
