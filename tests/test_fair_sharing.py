"""Fair sharing between callers: the engine admits waiting requests in callers' turns, so a newcomer is served
next to a flooder, not behind it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import engine
from engine.serving.batcher import in_turns


def job(caller: str, submitted: float) -> SimpleNamespace:
    return SimpleNamespace(ticket=SimpleNamespace(caller=caller), submitted=submitted, name=f"{caller}{submitted:g}")


def names(jobs) -> list[str]:
    return [j.name for j in jobs]


def test_one_callers_requests_keep_their_order():
    line = [job("a", t) for t in (1, 2, 3)]
    assert names(in_turns(line, {"a": 0})) == ["a1", "a2", "a3"]


def test_a_newcomer_goes_ahead_of_a_flooders_next_request():
    line = [job("a", t) for t in range(3, 25)] + [job("b", 25)]
    assert names(in_turns(line, {"a": 7}))[:3] == ["b25", "a3", "a4"]


def test_callers_take_turns_request_by_request_the_longest_unserved_first():
    line = [job("a", 1), job("a", 2), job("a", 3), job("c", 4), job("c", 5), job("b", 6)]
    assert names(in_turns(line, {"a": 3, "c": 2})) == ["b6", "c4", "a1", "c5", "a2", "a3"]


def test_callers_never_served_go_by_arrival():
    line = [job("a", 1), job("a", 2), job("c", 3), job("b", 4)]
    assert names(in_turns(line, {})) == ["a1", "c3", "b4", "a2"]


# ---- the tiny embedded model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipe():
    engine.enable_compile_cache()  # the session's: test_serving.py's engines of one slot run this plan too
    pipe = engine.load_pipeline(max_batch_size=1)
    yield pipe
    pipe.close()


def request(seed: int, steps: int) -> engine.GenerationRequest:
    return engine.GenerationRequest("a red circle", seed=seed, num_inference_steps=steps, num_images=1)


def test_a_small_request_is_admitted_next_to_24_heavy_ones_of_another_key(pipe):
    started: list[str] = []  # names in the order of their first step, as the engine's one thread emits them

    def watch(ticket: engine.Ticket, name: str) -> engine.Ticket:
        ticket.subscribe(
            lambda e: started.append(name) if isinstance(e, engine.Progress) and name not in started else 0
        )
        return ticket

    heavy = [watch(pipe.submit(request(k, steps=30), caller="key 1"), f"heavy {k}") for k in range(24)]
    running = len(started)  # heavy ones that had a slot before the small one came (the others wait)
    small = watch(pipe.submit(request(99, steps=2), caller="key 2"), "small")
    places = [e.position for e in small.events(timeout=300) if isinstance(e, engine.Queued)]
    for ticket in heavy:
        ticket.cancel()
    assert small.result().images
    assert started.index("small") <= running + 1  # after the heavy one in the slot when it came, before all others
    assert all(place <= 2 for place in places)  # told so: at most that one ahead of it in line
