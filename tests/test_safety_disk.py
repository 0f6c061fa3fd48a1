"""Disk stays bounded: the pictures the page draws are deleted after their time (an hour by default) or once more
than the registry keeps are written, and Gradio's copies of them in its cache are swept on the same schedule
(`delete_cache`). Over the stand-in engine, in-process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gradio.utils import get_upload_folder

import engine
import web
from tests._api_server import FakeEngine, ServedApp
from web import handlers
from web.pictures import ClientFiles


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def draw(pipe: FakeEngine, files: ClientFiles, seeds: range, num_images: int) -> list[str]:
    """The pages' pictures for these requests, written as the page writes them; their paths."""

    async def run():
        paths = []
        for seed in seeds:
            ticket = pipe.submit(
                engine.GenerationRequest("a cat", seed=seed, num_images=num_images, width=64, height=64)
            )
            async for gallery, _, _ in handlers.stream(pipe, ticket.request, ticket, files=files):
                if gallery and isinstance(gallery[0][0], str):
                    paths += [path for path, _ in gallery]
        return paths

    return asyncio.run(run())


def test_many_pictures_drawn_leave_no_more_files_than_the_registry_keeps(tmp_path):
    folder = tmp_path / "pictures"
    folder.mkdir()
    files = ClientFiles(10**6, upload_folder=tmp_path / "uploads", capacity=40, folder=folder)
    paths = draw(FakeEngine(), files, range(100), num_images=4)
    assert len(paths) == 400
    left = sorted(folder.iterdir())
    assert len(left) == 40 and {str(p) for p in left} == set(paths[-40:])  # the newest, still served
    assert files.may_open(paths[-1]) and not files.may_open(paths[0])


def test_a_picture_is_deleted_once_its_time_is_out(tmp_path):
    clock = Clock()
    files = ClientFiles(10**6, upload_folder=tmp_path, ttl_s=3600, folder=tmp_path, clock=clock)
    old = [files.new_picture() for _ in range(3)]
    clock.now += 1800
    newer = files.new_picture()
    clock.now += 1801  # the first three are past their hour; the newer one is not
    files.sweep()
    assert [Path(p).exists() for p in [*old, newer]] == [False, False, False, True]
    assert not files.may_open(old[0]) and files.may_open(newer)


def test_the_pages_pictures_leave_gradios_cache_with_ours(tmp_path):
    from gradio_client import Client

    cache = Path(get_upload_folder())

    def cached(name: str) -> bool:
        return any(cache.glob(f"*/{name}"))

    app = web.build_app(FakeEngine(), picture_ttl_s=60)
    assert app.state.demo.delete_cache == (60, 60)  # the uploads in Gradio's cache, swept by Gradio on our schedule
    app.state.files.clock = clock = Clock()
    with ServedApp(app) as url:
        client = Client(url, verbose=False, download_files=str(tmp_path))

        def picture_name(seed: int) -> str:
            gallery, _, _ = client.predict("a cat", "", seed, False, 2, 7.5, "ddim", "64x64", 1, api_name="/generate")
            return Path(gallery[0]["image"]).name  # as Gradio's cache names it: our file's (unique) name

        names = [picture_name(seed) for seed in (1, 2, 3)]
        assert all(cached(name) for name in names), "the pictures are served from Gradio's cache"
        clock.now += 61
        names.append(picture_name(4))
    assert [cached(name) for name in names] == [False, False, False, True]
