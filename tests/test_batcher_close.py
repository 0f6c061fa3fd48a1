"""A closed engine's batcher: a request sent after it closed is refused at once, and the requests it still held when
it closed end with a failure that says why, rather than leaving their callers waiting forever."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import engine
from engine.serving.batcher import Batcher
from engine.serving.ticket import Failed, Ticket


def idle_batcher() -> Batcher:
    """A batcher that never places a request (no programs behind it): what it holds stays waiting."""
    batcher = Batcher(programs=None, params=None, blank=None, devices=[], lanes=None)
    batcher._place = lambda: None
    return batcher


def job() -> SimpleNamespace:
    ticket = Ticket(engine.GenerationRequest("a red circle"), [])
    return SimpleNamespace(ticket=ticket, failed=False)


def test_a_request_sent_after_close_is_refused_saying_to_try_again():
    batcher = idle_batcher()
    batcher.close()
    with pytest.raises(engine.Busy, match="shut down.*try again"):
        batcher.submit(job())


def test_requests_held_at_close_fail_with_the_reason_instead_of_waiting():
    batcher = idle_batcher()
    held = [job(), job()]
    for j in held:
        batcher.submit(j)
    batcher.close()
    for j in held:
        assert j.ticket.done
        with pytest.raises(engine.GenerationFailed, match="closed this model's engine"):
            j.ticket.result(timeout=0)
        assert isinstance(j.ticket._history[-1], Failed)
