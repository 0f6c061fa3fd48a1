"""Every door behind the same credentials, and errors that say nothing of the server's insides.

Gradio mounts its MCP server (`/gradio_api/mcp/`: the tool schema, `/sse`, `/messages/`, the streamable HTTP route)
outside its own login; the gate (web/api_gate.py) serves it only to a caller with the page's credentials, as it
serves the REST APIs. A number no API can take (a seed of 400 digits) is each API's own 4xx, and a failure is a
500 that says "internal error" and an id, which the log holds with the details. Over the stand-in engine, in-process.
"""

from __future__ import annotations

import logging
import re

import pytest
from fastapi.testclient import TestClient

import engine
from tests._api_server import FakeEngine, fake_app
from web.throttle import LoginThrottle

MCP_ROUTES = [
    ("GET", "/gradio_api/mcp/schema"),
    ("GET", "/gradio_api/mcp/sse"),
    ("POST", "/gradio_api/mcp/messages/?session_id=0123456789abcdef0123456789abcdef"),
    ("POST", "/gradio_api/mcp/"),
]
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}},
}


@pytest.fixture(scope="module")
def closed():
    # The probes below fail a dozen logins from the one test address: neither slowed nor refused here.
    lenient = LoginThrottle(slow_after=100, max_failures=100)
    app = fake_app(
        FakeEngine(), auth=[("ann", "secret-a")], api_keys=["sk-jaxsd-key-1"], mcp=True, login_throttle=lenient
    )
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize(("method", "path"), MCP_ROUTES)
def test_mcp_is_refused_to_anonymous_and_wrong_credentials(closed, method, path):
    for auth in (None, ("ann", "wrong"), ("bob", "secret-a")):
        answer = closed.request(method, path, auth=auth, json=INITIALIZE if method == "POST" else None)
        assert answer.status_code == 401 and "Basic" in answer.headers["www-authenticate"], (auth, answer.text)
    answer = closed.post("/gradio_api/mcp/", headers={"Authorization": "Bearer not-a-key"}, json=INITIALIZE)
    assert answer.status_code == 401


def test_mcp_serves_the_pages_users_and_the_api_keys(closed):
    for credentials in ({"auth": ("ann", "secret-a")}, {"headers": {"Authorization": "Bearer sk-jaxsd-key-1"}}):
        answer = closed.get("/gradio_api/mcp/schema", **credentials)
        assert answer.status_code == 200 and "generate" in answer.text, answer.text


def test_an_api_key_alone_closes_mcp_too_and_neither_leaves_it_open():
    with TestClient(fake_app(FakeEngine(), api_keys=["sk-jaxsd-key-1"], mcp=True)) as client:
        assert client.get("/gradio_api/mcp/schema").status_code == 401
        assert client.get("/gradio_api/mcp/schema", auth=("any", "sk-jaxsd-key-1")).status_code == 200
    with TestClient(fake_app(FakeEngine(), mcp=True)) as client:
        assert client.get("/gradio_api/mcp/schema").status_code == 200


# ---- numbers out of range, and failures ------------------------------------------------------------------------

HUGE_SEED = int("9" * 400)


def test_a_seed_of_400_digits_is_refused_in_each_apis_own_shape():
    with TestClient(fake_app(FakeEngine())) as client:
        answer = client.post("/sdapi/v1/txt2img", json={"prompt": "a cat", "seed": HUGE_SEED})
        assert answer.status_code == 422 and "seed is out of range" in answer.json()["detail"], answer.text
        answer = client.post("/v1/images/generations", json={"prompt": "a cat", "seed": HUGE_SEED})
        assert answer.status_code == 400 and "seed is out of range" in answer.json()["error"]["message"], answer.text
        assert "9" * 40 not in answer.text


def test_the_page_refuses_a_seed_of_400_digits_with_a_message():
    from web import requests

    for seed in (HUGE_SEED, "9" * 400, 1e300):
        with pytest.raises(engine.InvalidRequest, match="Seed") as refused:
            requests.parse_request(FakeEngine(), "a cat", "", seed, False, 2, 7.5, "ddim", "64x64", 1)
        assert "9" * 40 not in str(refused.value)


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [("/sdapi/v1/txt2img", {"prompt": "a cat"}, "detail"), ("/v1/images/generations", {"prompt": "a cat"}, "error")],
)
def test_a_failure_says_internal_error_and_an_id_that_the_log_holds_with_the_details(path, body, shape, caplog):
    failing = FakeEngine(error=engine.GenerationFailed("cannot open /srv/models/secret/unet.safetensors"))
    with TestClient(fake_app(failing)) as client, caplog.at_level(logging.ERROR, logger="jax-sd"):
        answer = client.post(path, json=body)
    assert answer.status_code == 500 and "/srv/models" not in answer.text
    said = answer.json()[shape] if shape == "detail" else answer.json()["error"]["message"]
    ident = re.fullmatch(r"internal error ([0-9a-f]{12})", said).group(1)
    assert any(ident in line and "/srv/models/secret" in line for line in caplog.text.splitlines())


def test_an_unexpected_crash_in_an_api_is_an_internal_error_in_its_shape(caplog):
    class Crashing(FakeEngine):
        def submit(self, request, caller=""):
            raise RuntimeError("segment at /opt/jax-sd/engine/x.py")

    with TestClient(fake_app(Crashing()), raise_server_exceptions=False) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert answer.status_code == 500 and "/opt/jax-sd" not in answer.text
    assert answer.json()["error"]["message"].startswith("internal error ")
