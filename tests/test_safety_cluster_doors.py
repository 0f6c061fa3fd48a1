"""The cluster's page has the doors of `python app.py`: its settings take `auth`, `api_keys`, `max_body_mb`,
`max_picture_pixels` and `mcp` with the flags' meanings, refuse what the flags refuse, and reach the same
`web.build_app`, so that the page, both REST APIs and MCP are closed alike.

The page's app is built as the ingress builds it (`cluster.ingress.page_app`), over the stand-in engine and
in-process: no Ray is started here.
"""

from __future__ import annotations

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
        ({"api_key": KEY}, "unknown settings \\['api_key'\\]"),
    ],
)
def test_a_bad_door_setting_is_refused_with_what_is_wrong(args, message):
    with pytest.raises(ValueError, match=message):
        ClusterSettings.from_args(args)


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
