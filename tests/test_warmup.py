"""The warm-up after Ready (engine/serving/warmup.py): the plans nobody waits for yet compile one at a time, each
once the engine has been idle a while, so that a first request drawing meanwhile keeps the cores."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from engine.serving import warmup
from engine.serving.batcher import Batcher, Idleness


class FakePlan:
    def __init__(self, name: str, slots: int = 4):
        self.name, self.slots_per_device, self.devices = name, slots, 1

    def __repr__(self) -> str:
        return self.name


class FakePrograms:
    """Records what is asked of it, in order, and answers at once."""

    def __init__(self, said: list):
        self.said = said

    def request(self, plan, width, on_done=None, pin=False, background=False) -> Future:
        self.said.append(("compile", repr(plan), width, pin, background))
        future: Future = Future()
        future.set_result(None)
        return future


def test_after_ready_each_plan_waits_for_an_idle_engine_and_compiles_in_the_background(monkeypatch):
    monkeypatch.setattr(warmup, "QUIET_S", 0.1)
    said, done = [], threading.Event()

    def wait_until_idle(quiet: float) -> bool:
        said.append(("wait", quiet))
        if len([s for s in said if s[0] == "wait"]) == 3:
            threading.Timer(0.05, done.set).start()
        return True

    default, other = FakePlan("default"), FakePlan("other")
    warmup.warmup(FakePrograms(said), [default, other], 1, 1, False, wait_until_idle)
    assert said == [("compile", "default", 1, True, False)]  # Ready: asked for, at the process's priority
    time.sleep(0.05)
    assert len(said) == 1  # nothing more until QUIET_S after Ready: a visitor who came for Ready goes first
    assert done.wait(5)
    assert said[1:] == [
        ("wait", 0.1),
        ("compile", "other", 1, True, True),  # the guidance slider's other side, kept for good
        ("wait", 0.1),
        ("compile", "default", 4, False, True),  # the whole batch's width of both
        ("wait", 0.1),
        ("compile", "other", 4, False, True),
    ]


def test_a_closed_engine_stops_the_warm_up_after_ready(monkeypatch):
    monkeypatch.setattr(warmup, "QUIET_S", 0.05)
    said = []
    warmup.warmup(FakePrograms(said), [FakePlan("default"), FakePlan("other")], 1, 1, False, lambda quiet: False)
    time.sleep(0.2)
    assert said == [("compile", "default", 1, True, False)]


def test_waiting_for_all_compiles_everything_at_once_without_waiting_for_idleness():
    said = []
    warmup.warmup(FakePrograms(said), [FakePlan("default"), FakePlan("other")], 1, 1, True, lambda quiet: 1 / 0)
    assert [s[1:] for s in said] == [("default", 1, True, False), ("other", 1, True, False),
                                     ("default", 4, False, False), ("other", 4, False, False)]  # fmt: skip


def test_the_batcher_is_idle_once_no_request_has_waited_or_drawn_for_the_quiet_time():
    batcher = Batcher(programs=None, params=None, blank=None, devices=[], lanes=None)
    try:
        start = time.monotonic()
        assert batcher.idle.wait(5.0) and time.monotonic() - start < 1  # nothing asked yet: idle at once
        batcher.idle.busy()  # a request waited or drew just now
        start = time.monotonic()
        assert batcher.idle.wait(0.5) and time.monotonic() - start >= 0.5
        batcher.idle.busy(drawing=True)  # a chunk being drawn, however long it takes
        start = time.monotonic()  # before the timer starts, so that its 0.6 s are counted from here
        threading.Timer(0.6, lambda: batcher.idle.busy(drawing=False)).start()
        assert batcher.idle.wait(0.2) and time.monotonic() - start >= 0.8
    finally:
        batcher.close()
    assert not batcher.idle.wait(5.0)  # closed: nothing more to warm up


def test_a_chunk_that_raises_leaves_the_engine_idle_not_drawing():
    idle = Idleness()
    try:
        with idle.drawing_chunk():
            assert idle.drawing
            raise RuntimeError("the chunk failed")
    except RuntimeError:
        pass
    start = time.monotonic()
    assert not idle.drawing and idle.wait(0.2) and 0.15 <= time.monotonic() - start < 1  # quiet once, then idle
