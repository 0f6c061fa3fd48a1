"""Failed logins from one address are slowed after a few, then refused for a while with 429 and Retry-After:
at the page's login form (Gradio's /login with --auth) and at the APIs' gate (HTTP Basic or Bearer), counted
together. Other addresses, and the address once its time is out, log in as before. Over the stand-in engine,
in-process, with a clock of the test's own.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

import web
from tests._api_server import FakeEngine
from web.throttle import LoginThrottle


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def throttle(clock, **changes) -> LoginThrottle:
    options = dict(slow_after=2, max_failures=4, window_s=60, lockout_s=30, delay_s=0.01, max_delay_s=0.04)
    return LoginThrottle(**(options | changes), clock=clock)


# ---- the counter ------------------------------------------------------------------------------------------------


def test_failures_are_slowed_from_the_slow_after_th_then_the_address_is_refused_for_the_lockout():
    clock = Clock()
    counter = throttle(clock, max_failures=6)
    delays = [counter.failed("10.0.0.1") for _ in range(5)]
    assert delays == [0.0, 0.0, 0.01, 0.02, 0.04]  # doubling, up to max_delay_s
    assert counter.retry_after("10.0.0.1") is None
    assert counter.failed("10.0.0.1") == 0.0  # the sixth: refused from now on, its own answer not held
    assert counter.retry_after("10.0.0.1") == 30
    clock.now += 29.5
    assert counter.retry_after("10.0.0.1") == 1
    clock.now += 0.5
    assert counter.retry_after("10.0.0.1") is None
    assert counter.failed("10.0.0.1") == 0.0  # a fresh window after the lockout


def test_only_failures_within_the_window_count_and_a_success_forgets_them():
    clock = Clock()
    counter = throttle(clock)
    for _ in range(3):
        counter.failed("a")
        clock.now += 61  # each outside the last one's window
    assert counter.retry_after("a") is None and counter.failed("a") == 0.0
    counter.failed("a")
    counter.succeeded("a")
    assert counter.remembered == 0


def test_one_addresses_failures_leave_the_others_alone():
    counter = throttle(Clock())
    for _ in range(4):
        counter.failed("a")
    assert counter.retry_after("a") == 30 and counter.retry_after("b") is None


def test_the_addresses_remembered_are_bounded():
    counter = throttle(Clock(), capacity=100)
    for k in range(10_000):
        counter.failed(f"10.{k // 256}.{k % 256}.1")
    assert counter.remembered == 100


# ---- through the app ------------------------------------------------------------------------------------------

ANN = ("ann", "secret-a")
KEY = "sk-jaxsd-key-1"


@pytest.fixture()
def site():
    clock = Clock()
    app = web.build_app(
        FakeEngine(), auth=[ANN], api_keys=[KEY], login_throttle=throttle(clock, delay_s=0.2, max_delay_s=0.2)
    )
    app.state.clock = clock
    return app


def login(client, password: str):
    return client.post("/login", data={"username": "ann", "password": password})


def test_the_login_form_is_slowed_then_refused_with_retry_after_then_open_again(site):
    client = TestClient(site, client=("203.0.113.7", 50000))
    assert [login(client, "wrong").status_code for _ in range(2)] == [400, 400]
    started = time.monotonic()
    assert login(client, "wrong").status_code == 400
    assert time.monotonic() - started >= 0.2  # the third failure is held
    assert login(client, "wrong").status_code == 400  # the fourth: the address is refused from now on
    for password in ("wrong", "secret-a"):  # a right password is refused too: no guess is confirmed meanwhile
        answer = login(client, password)
        assert answer.status_code == 429 and answer.headers["retry-after"] == "30", answer.text
        assert "too many failed logins" in answer.json()["detail"]
    other = TestClient(site, client=("198.51.100.9", 50000))
    assert login(other, "secret-a").status_code == 200  # another address logs in as before
    site.state.clock.now += 30
    assert login(client, "secret-a").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/images/generations", {"prompt": "a cat", "size": "64x64"}, lambda j: j["error"]["message"]),
        ("/sdapi/v1/txt2img", {"prompt": "a cat", "width": 64, "height": 64}, lambda j: j["detail"]),
    ],
)
def test_wrong_api_credentials_are_refused_for_a_while_in_the_apis_own_shape(site, path, body, shape):
    client = TestClient(site, client=("203.0.113.8", 50000))
    wrong = [{"Authorization": "Bearer sk-not-a-key"}, {"Authorization": "Basic YW5uOndyb25n"}]  # ann:wrong
    assert [client.post(path, json=body, headers=wrong[k % 2]).status_code for k in range(4)] == [401] * 4
    answer = client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 429 and answer.headers["retry-after"] == "30"
    assert "too many failed logins" in shape(answer.json())
    site.state.clock.now += 30
    assert client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_missing_credential_is_no_failed_login_and_both_doors_count_together(site):
    client = TestClient(site, client=("203.0.113.9", 50000))
    for _ in range(10):
        assert client.get("/sdapi/v1/options").status_code == 401  # no credential sent: nothing counted
    assert login(client, "secret-a").status_code == 200
    for _ in range(2):
        login(client, "wrong")
    for _ in range(2):
        client.get("/sdapi/v1/options", auth=("ann", "wrong"))
    assert client.get("/sdapi/v1/options", auth=ANN).status_code == 429
    assert login(client, "secret-a").status_code == 429
