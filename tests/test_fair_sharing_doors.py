"""Fair sharing at the doors: who a caller is, each caller's share of the engine (429 with Retry-After beyond it,
the page's "busy" message), A1111's progress and interrupt about the caller's own requests only, X-Forwarded-For
from trusted proxies only, and a client that hangs up has its request stopped. The stand-in engine, in-process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time

import gradio as gr
import pytest
import requests

import engine
from tests._api_server import FakeEngine, ServedApp, fake_app
from web.callers import Caller, CallerBusy, CallerLimits, ForwardedFor, caller_of, read_forwarded_allow_ips
from web.page import run_generation

KEYS = ["key-one-1111", "key-two-2222"]
WAIT_S = 20


def held(steps: int = 4, images: int = 1) -> engine.GenerationRequest:
    return engine.GenerationRequest("a red circle", num_inference_steps=steps, num_images=images)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        time.sleep(0.02)


# ---- each caller's share --------------------------------------------------------------------------------------


def test_a_caller_holds_a_bounded_number_of_requests_and_others_are_unaffected():
    pipe, limits = FakeEngine(hold=True), CallerLimits(max_requests=2, max_work=1000)
    ann, bob = Caller("ann"), Caller("bob")
    first = [limits.submit(pipe, held(), ann) for _ in range(2)]
    with pytest.raises(CallerBusy, match="busy with your requests"):
        limits.submit(pipe, held(), ann)
    assert limits.submit(pipe, held(), bob).caller == "bob"  # another caller's share is its own
    first[0].cancel()  # one done: room for one more
    assert limits.held(ann) == (1, 4) and limits.submit(pipe, held(), ann).caller == "ann"


def test_a_caller_holds_a_bounded_amount_of_work_but_its_first_request_is_always_taken():
    pipe, limits = FakeEngine(hold=True), CallerLimits(max_requests=8, max_work=100)
    ann = Caller("ann")
    limits.submit(pipe, held(steps=40, images=4), ann)  # 160 images x steps, alone: taken
    with pytest.raises(CallerBusy):
        limits.submit(pipe, held(steps=2), ann)
    assert limits.held(ann) == (1, 160)


def test_a_request_the_engine_refuses_holds_nothing():
    pipe, limits = FakeEngine(error=engine.InvalidRequest("no")), CallerLimits(max_requests=1)
    with pytest.raises(engine.InvalidRequest):
        limits.submit(pipe, held(), Caller("ann"))
    assert limits.held(Caller("ann")) == (0, 0)


@pytest.mark.parametrize(
    "path, body, shape, stopped",
    [
        ("/sdapi/v1/txt2img", {"prompt": "a red circle", "steps": 4}, "detail", 200),
        ("/v1/images/generations", {"prompt": "a red circle", "num_inference_steps": 4}, "error", 409),
    ],
)
def test_beyond_its_share_a_caller_gets_429_with_retry_after_at_once_at_each_api(path, body, shape, stopped):
    pipe = FakeEngine(hold=True)
    app = fake_app(pipe, api_keys=KEYS, max_caller_requests=1)
    one, two = ({"Authorization": f"Bearer {key}"} for key in KEYS)
    with ServedApp(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(requests.post, f"{url}{path}", json=body, headers=one, timeout=WAIT_S)
        wait_for(lambda: len(pipe.tickets) == 1, "request in the engine")
        started = time.monotonic()
        refused = requests.post(f"{url}{path}", json=body, headers=one, timeout=WAIT_S)
        assert refused.status_code == 429 and time.monotonic() - started < 5
        assert int(refused.headers["Retry-After"]) > 0
        said = refused.json()["detail"] if shape == "detail" else refused.json()["error"]["message"]
        assert "busy with your requests" in said
        other = pool.submit(requests.post, f"{url}{path}", json=body, headers=two, timeout=WAIT_S)
        wait_for(lambda: len(pipe.tickets) == 2, "the other key's request in the engine")
        assert [t.caller for t in pipe.tickets] == ["key 1", "key 2"]
        for ticket in pipe.tickets:
            ticket.cancel()
        assert waiting.result().status_code == other.result().status_code == stopped  # each API's "interrupted"


def test_the_page_says_busy_when_its_caller_is_over_its_share():
    pipe, limits = FakeEngine(hold=True), CallerLimits(max_requests=1)
    ann = Caller("session 1")
    limits.submit(pipe, held(), ann)
    raw = dict(prompt="a red circle", negative_prompt="", seed=1, random_seed=False, steps=4, guidance_scale=7.0)
    raw |= dict(scheduler="ddim", size="64x64", images_per_device=1)

    async def draw():
        async for _ in run_generation(pipe, raw, None, limits=limits, caller=ann):
            pass

    with pytest.raises(gr.Error, match="busy with your requests"):
        asyncio.run(draw())


# ---- who a caller is ----------------------------------------------------------------------------------------


def scope(client: str, forwarded: str | None = None, **state) -> dict:
    headers = [(b"x-forwarded-for", forwarded.encode())] if forwarded else []
    return {"type": "http", "client": (client, 5000), "headers": headers, "state": state}


def through(allowed: str, given: dict) -> dict:
    seen = {}

    async def app(scope, receive, send):
        seen.update(scope)

    asyncio.run(ForwardedFor(app, read_forwarded_allow_ips(allowed))(given, None, None))
    return seen


def test_a_caller_is_its_credential_else_its_session_else_its_address():
    assert caller_of(scope("10.0.0.9", api_caller="key 2"), session="s1") == Caller("key 2")
    assert caller_of(scope("10.0.0.9"), session="s1", user="ann") == Caller("ann")
    assert caller_of(scope("10.0.0.9"), session="s1") == Caller("session s1")
    assert caller_of(scope("10.0.0.9")) == Caller("address 10.0.0.9")


def test_x_forwarded_for_is_read_only_from_the_proxies_named():
    trusted = through("10.0.0.0/8", scope("10.0.0.2", "203.0.113.7, 10.0.0.5"))
    assert caller_of(trusted) == Caller("address 203.0.113.7")
    untrusted = through("10.0.0.0/8", scope("198.51.100.1", "203.0.113.7"))
    assert caller_of(untrusted) == Caller("address 198.51.100.1", shared=True)  # everyone behind it is one
    assert caller_of(through("", scope("198.51.100.1"))) == Caller("address 198.51.100.1")
    assert caller_of(through("*", scope("198.51.100.1", "203.0.113.8"))) == Caller("address 203.0.113.8")
    with pytest.raises(ValueError, match="not an address"):
        read_forwarded_allow_ips("10.0.0.1,proxy.example")


# ---- A1111's progress and interrupt ----------------------------------------------------------------------------


def test_progress_and_interrupt_touch_only_the_callers_own_behind_a_trusted_proxy():
    pipe = FakeEngine(hold=True)
    app = fake_app(pipe, forwarded_allow_ips=("127.0.0.1",))
    ann, bob = ({"X-Forwarded-For": address} for address in ("203.0.113.7", "203.0.113.8"))
    body = {"prompt": "a red circle", "steps": 4}
    with ServedApp(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        drawing = {name: pool.submit(requests.post, f"{url}/sdapi/v1/txt2img", json=body, headers=h, timeout=WAIT_S)
                   for name, h in (("ann", ann), ("bob", bob))}  # fmt: skip
        wait_for(lambda: len(pipe.tickets) == 2, "both requests in the engine")
        progress = requests.get(f"{url}/sdapi/v1/progress", headers=ann, timeout=WAIT_S).json()
        assert progress["state"]["job_count"] == 1 and progress["current_image"]  # its own preview
        assert requests.post(f"{url}/sdapi/v1/interrupt", headers=ann, timeout=WAIT_S).status_code == 200
        assert drawing["ann"].result().json()["images"] == []
        (bobs,) = [ticket for ticket in pipe.tickets if ticket.caller == "address 203.0.113.8"]
        assert not drawing["bob"].done() and not bobs.cancel_requested
        bobs.cancel()


def test_anonymous_callers_behind_an_untrusted_proxy_get_progress_without_a_preview():
    pipe = FakeEngine(hold=True)
    forwarded = {"X-Forwarded-For": "203.0.113.7"}
    with ServedApp(fake_app(pipe)) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {"prompt": "a red circle", "steps": 4}
        drawing = pool.submit(requests.post, f"{url}/sdapi/v1/txt2img", json=body, headers=forwarded, timeout=WAIT_S)
        wait_for(lambda: len(pipe.tickets) == 1, "the request in the engine")
        progress = requests.get(f"{url}/sdapi/v1/progress", headers=forwarded, timeout=WAIT_S).json()
        assert progress["state"]["job_count"] == 1 and progress["current_image"] is None
        pipe.tickets[0].cancel()
        drawing.result()


# ---- a client that hangs up -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/sdapi/v1/txt2img", "/v1/images/generations"])
def test_a_client_that_hangs_up_has_its_ticket_cancelled(path):
    pipe = FakeEngine(hold=True)
    body = b'{"prompt": "a red circle"}'
    with ServedApp(fake_app(pipe)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
            head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(lambda: len(pipe.tickets) == 1, "the request in the engine")
        wait_for(lambda: pipe.tickets[0].cancel_requested, "cancel after the client left")
