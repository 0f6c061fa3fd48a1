"""Every door behind the same credentials, and errors that say nothing of the server's insides.

Gradio mounts its MCP server (`/gradio_api/mcp/`: the tool schema, `/sse`, `/messages/`, the streamable HTTP route)
outside its own login; the gate (web/api_gate.py) serves it only to a caller with the page's credentials, as it
serves the REST APIs. Over the stand-in engine, in-process.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests._api_server import FakeEngine, fake_app

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
    app = fake_app(FakeEngine(), auth=[("ann", "secret-a")], api_keys=["sk-jaxsd-key-1"], mcp=True)
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
