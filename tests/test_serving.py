"""Many users at once: continuous batching, previews, Stop, faults, fairness and the bounded program cache.

All on the embedded model, on the CPU. Timing is never asserted; order is, by the events each request sees.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

from engine import (
    Busy,
    Cancelled,
    Failed,
    Finished,
    GenerationFailed,
    GenerationRequest,
    InvalidRequest,
    Preview,
    Progress,
    Queued,
    enable_compile_cache,
    load_pipeline,
)

pytestmark = pytest.mark.serving
WAIT_S = 300  # no request in this file may take longer: a hang fails instead of blocking the suite


@pytest.fixture(scope="module", autouse=True)
def compile_cache():
    # Engines with the same batch shapes share their programs through the (session's) disk cache.
    enable_compile_cache()


@pytest.fixture(scope="module")
def pipe():
    engine = load_pipeline(max_batch_size=4)
    yield engine
    engine.close()


def request(prompt="a red circle on a blue background", **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt, **{"num_inference_steps": 6, "num_images": 1, **kwargs})


def alone(pipe, r: GenerationRequest) -> np.ndarray:
    return pipe.submit(r).result(WAIT_S).arrays


def events(ticket) -> list:
    return list(ticket.events(timeout=WAIT_S))


MIXED = [
    request(seed=1),
    request("a yellow star on a purple background", seed=2, num_inference_steps=9, guidance_scale=3.0),
    request("a small orange square on a green background", seed=3, num_inference_steps=3, guidance_scale=9.0),
    request("a large white triangle on a black background", seed=4, num_images=2, negative_prompt="blurry"),
]


def test_concurrent_mixed_requests_each_get_their_own_pictures(pipe):
    want = [alone(pipe, r) for r in MIXED]
    tickets = [pipe.submit(r) for r in MIXED]  # all at once: they share the batch
    for ticket, expected, r in zip(tickets, want, MIXED, strict=True):
        result = ticket.result(WAIT_S)
        assert result.seeds == r.image_seeds()
        assert result.request.num_inference_steps == r.num_inference_steps
        assert np.abs(result.arrays - expected).max() <= 1 / 255
    assert np.abs(want[0] - want[1][:1]).max() > 0.05  # the four requests really draw different pictures


def test_a_late_request_starts_before_the_early_one_finishes(pipe):
    early = pipe.submit(request(seed=5, num_inference_steps=60))
    seen = []
    early.subscribe(seen.append)
    while not any(isinstance(e, Progress) and e.step >= 3 for e in seen):
        threading.Event().wait(0.01)
    late = pipe.submit(request(seed=6, num_inference_steps=4))
    late_events = events(late)
    assert isinstance(late_events[-1], Finished)
    assert not early.done, "the late request waited for the early one's whole run"
    assert isinstance(events(early)[-1], Finished)


def test_each_request_sees_its_own_progress_and_previews_before_its_pictures(pipe):
    assert pipe.preview is not None  # fitted in the background at load: previews start once it is
    got = events(pipe.submit(request(seed=7, num_inference_steps=8, height=64, width=88)))
    steps = [e.step for e in got if isinstance(e, Progress)]
    assert steps == sorted(steps) and steps[-1] == 8
    previews = [e for e in got if isinstance(e, Preview)]
    assert previews, "no preview before the pictures"
    assert previews[0].images[0].shape == (8, 11, 3) and previews[0].images[0].dtype == np.uint8
    assert got.index(previews[0]) < len(got) - 1 and isinstance(got[-1], Finished)


def test_the_preview_map_is_fitted_to_the_models_vae(pipe):
    result = pipe.submit(request(seed=8, num_inference_steps=20)).result(WAIT_S)
    assert pipe.preview is not None
    assert pipe.preview.fit_error < 0.2  # RMS, 0..1 units: a rough picture, which is what a preview is
    assert result.arrays.std() > 0.05


def test_a_preview_map_that_cannot_be_fitted_leaves_the_engine_serving_without_previews(monkeypatch):
    import engine.serving.engine

    def broken(*_):
        raise RuntimeError("no VAE today")

    monkeypatch.setattr(engine.serving.engine, "fit_preview", broken)
    alone_engine = load_pipeline(max_batch_size=1)
    try:
        got = events(alone_engine.submit(request(seed=3, num_inference_steps=3)))
        assert alone_engine.preview is None
        assert isinstance(got[-1], Finished) and not any(isinstance(e, Preview) for e in got)
    finally:
        alone_engine.close()


def test_stop_frees_the_slots_and_the_others_finish_untouched(pipe):
    keep = request(seed=9, num_inference_steps=12)
    want = alone(pipe, keep)
    stopped = pipe.submit(request(seed=10, num_inference_steps=150, num_images=2))
    kept = pipe.submit(keep)
    for event in stopped.events(timeout=WAIT_S):
        if isinstance(event, Progress) and event.step >= 2:
            stopped.cancel()
    with pytest.raises(Cancelled):
        stopped.result(WAIT_S)
    assert np.abs(kept.result(WAIT_S).arrays - want).max() <= 1 / 255
    assert len(pipe.submit(request(seed=11)).result(WAIT_S).images) == 1


def test_nan_in_one_slot_fails_only_that_request(pipe):
    poisoned = np.full((1, 4, 8, 8), np.nan, np.float32)
    healthy = pipe.submit(request(seed=12, num_inference_steps=8))
    broken = pipe.submit(request(seed=13, latents=poisoned))
    with pytest.raises(GenerationFailed, match=r"image 1 \(seed 13\) diverged: NaN or inf"):
        broken.result(WAIT_S)
    assert np.isfinite(healthy.result(WAIT_S).arrays).all()


def test_an_exception_in_a_batch_fails_that_batch_and_the_next_is_served(pipe, monkeypatch):
    r = request(seed=14, height=64, width=96)  # a plan of its own, so the fault is only its batch's
    pipe.submit(r).result(WAIT_S)
    compiled = pipe.programs.get(pipe.plan(pipe.limits.resolve(r, pipe.defaults)))
    healthy = dict(compiled.lanes)

    def explode(*args):
        raise RuntimeError("device fell over")

    compiled.lanes = {w: dataclasses.replace(lanes, advance=explode) for w, lanes in healthy.items()}
    try:
        with pytest.raises(GenerationFailed, match="batch running this request failed: RuntimeError: device fell over"):
            pipe.submit(r).result(WAIT_S)
    finally:
        compiled.lanes = healthy
    assert len(pipe.submit(r).result(WAIT_S).images) == 1


def test_requests_of_another_size_take_their_turn():
    # One live batch at a time and one slot: a stream of one size cannot starve another size.
    engine = load_pipeline(max_batch_size=1, max_live_plans=1)
    try:
        # Both sizes compiled first: a request waiting for its compile lets others by (a compile stalls no one).
        for width in (64, 88):
            engine.submit(request(seed=19, num_inference_steps=1, width=width)).result(WAIT_S)
        square = [engine.submit(request(seed=s, num_inference_steps=4)) for s in (20, 21)]
        wide = engine.submit(request(seed=22, num_inference_steps=4, width=88))
        later = engine.submit(request(seed=23, num_inference_steps=4))
        order = []
        for name, ticket in (("square0", square[0]), ("square1", square[1]), ("wide", wide), ("later", later)):
            ticket.subscribe(lambda e, name=name: order.append(name) if isinstance(e, Finished) else None)
        for ticket in (*square, wide, later):
            ticket.result(WAIT_S)
        assert order.index("wide") < order.index("later")
        queued = [e.position for e in events(later) if isinstance(e, Queued)]
        assert queued and queued[0] >= 2  # it was told its place in line
    finally:
        engine.close()


def test_a_full_waiting_room_answers_at_once_and_serving_goes_on():
    engine = load_pipeline(max_batch_size=1, max_waiting=2)
    try:
        tickets, refused = [], []
        for seed in range(6):
            try:
                tickets.append(engine.submit(request(seed=seed, num_inference_steps=30)))
            except Busy as e:
                refused.append(str(e))
        assert refused and all("busy" in message for message in refused)
        for ticket in tickets:
            assert len(ticket.result(WAIT_S).images) == 1
        assert engine.submit(request(seed=9)).result(WAIT_S).images
    finally:
        engine.close()


def test_offered_sizes_are_the_only_ones_served():
    engine = load_pipeline(sizes="common", previews=False)
    try:
        assert (64, 64) in engine.limits.sizes and (88, 64) in engine.limits.sizes
        with pytest.raises(InvalidRequest, match="size 72x72 is not offered here; choose one of 64x64, 88x64"):
            engine.submit(request(width=72, height=72))
    finally:
        engine.close()


def resident_mb() -> float:
    """This process's resident memory after Python's collector and glibc's trim: what is still held, not what the
    allocator keeps cached for reuse (which varies from run to run)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_sweep_of_sizes_keeps_programs_and_memory_bounded():
    engine = load_pipeline(max_batch_size=1, max_plans=2, previews=False)
    try:
        sides = [64, 72, 80, 88, 96, 104]
        memory = []
        for side in sides:
            assert engine.submit(request(width=side, num_inference_steps=2)).result(WAIT_S).images[0].size == (side, 64)
            memory.append(resident_mb())
        assert engine.compile_count == len(sides)
        assert len(engine.compiled_plans) == 2
        assert [p.latent_width for p in engine.compiled_plans] == [12, 13]  # the two most recent
        # Unbounded, each size kept about 45 MB of programs for good; evicted, they are given back.
        assert memory[-1] - memory[1] < 130, memory  # unbounded: 4 x 45 MB; bounded measured 102-107 MB in the suite
    finally:
        engine.close()


def test_the_engine_is_safe_from_many_threads(pipe):
    results, errors = {}, []

    def user(k):
        try:
            results[k] = pipe.generate("a red circle", seed=100 + k, num_inference_steps=3, num_images=1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=user, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not errors and sorted(results) == list(range(8))
    assert all(results[k].seeds == [100 + k] for k in range(8))


def test_failed_requests_say_why(pipe):
    ticket = pipe.submit(request(seed=15, latents=np.full((1, 4, 8, 8), np.inf, np.float32)))
    last = events(ticket)[-1]
    assert isinstance(last, Failed) and "try another seed" in str(last.error)
