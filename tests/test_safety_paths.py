"""No path a client names is opened, unless it was uploaded to this server or the server wrote it.

A client can call every event of the page, private ones included, through Gradio's routes (`/gradio_api/run/predict`
with an event's `fn_index`, or its queue), with file data that carries Gradio's `meta` marker or not. The probe here
names a secret picture, a file that is no picture and a missing path at each event that takes a picture: each is
answered alike, with neither the path nor anything of the secret coming back. Over the stand-in engine, in-process.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient
from PIL import Image

import engine
from tests._api_server import FakeEngine, fake_app, png
from web.page import generate_signature
from web.pictures import NOT_OURS, ClientFiles

FORM = ["a cat", "", 7, 2, 7.5, "ddim", "64x64", 1, 0, 0.0, 0.0, "Latent", 0, 0.7]  # prompt ... hires_strength
META = {"meta": {"_type": "gradio.FileData"}}


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A secret picture, a file that is no picture and a missing path, none of them uploaded."""
    folder = tmp_path_factory.mktemp("not-uploaded")
    Image.new("RGB", (123, 45), (201, 13, 77)).save(folder / "secret.png")
    (folder / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    return {"secret": str(folder / "secret.png"), "no picture": str(folder / "passwd"), "missing": str(folder / "no")}


@pytest.fixture(scope="module")
def page():
    pipe = FakeEngine()
    pipe.limits = dataclasses.replace(pipe.limits, max_references=2)  # a model that edits: the Edit mode's gallery
    app = fake_app(pipe)
    with TestClient(app) as client:
        yield app.state.demo, client


def fn_index(demo, name: str) -> int:
    """An event's index by its function's name, or by an input's kind ("File": the PNG-info drop)."""
    return next(
        index
        for index, fn in demo.fns.items()
        if fn.name == name or any(type(block).__name__ == name for block in fn.inputs)
    )


def predict(client, demo, name: str, data: list, session: str = "probe") -> tuple[int, str]:
    """An event called as an outsider calls it, without the queue: (status, body)."""
    answer = client.post(
        "/gradio_api/run/predict", json={"fn_index": fn_index(demo, name), "data": data, "session_hash": session}
    )
    return answer.status_code, answer.text


def queued(client, demo, name: str, data: list, session: str) -> dict:
    """An event called through the page's queue: its final output (`data`, or `error`)."""
    join = {"fn_index": fn_index(demo, name), "data": data, "session_hash": session, "event_data": None}
    assert client.post("/gradio_api/queue/join", json={**join, "trigger_id": None}).status_code == 200
    with client.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as events:
        for line in events.iter_lines():
            message = json.loads(line[5:]) if line.startswith("data:") else {}
            if message.get("msg") == "process_completed":
                return message["output"]
    raise AssertionError("the queue closed without an answer")


def generate_values(control_image=None, picture=None, mask=None, mode="Text to image", references=None) -> list:
    head = ["a cat", "", 7, False, 2, 7.5, "ddim", "64x64", 1]
    values = [*head, control_image, False, 1.0, None, mode, picture, mask, 0.5, 0, 0.0]
    later = list(generate_signature()[0].parameters.values())[len(values) : -2]  # fields added since; then gradio's
    return values + [references if p.name == "references" else p.default for p in later]


def named(path: str, meta: bool) -> dict:
    return {"path": path, **(META if meta else {})}


# ---- the rule ----------------------------------------------------------------------------------------


def test_a_client_may_name_only_an_upload_or_a_file_this_server_wrote(tmp_path, outside):
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    Image.new("RGB", (8, 8), "blue").save(uploads / "mine.png")
    (uploads / "link.png").symlink_to(outside["secret"])  # inside by name, outside once resolved
    files = ClientFiles(10**6, upload_folder=uploads)
    assert files.picture({"path": str(uploads / "mine.png")}, "The picture").size == (8, 8)
    assert files.picture(None, "The picture") is None
    for path in [*outside.values(), str(uploads / "link.png"), str(uploads), str(uploads / ".." / "uploads"), ""]:
        with pytest.raises(engine.InvalidRequest) as refused:
            files.picture({"path": path}, "The picture")
        assert str(refused.value) == NOT_OURS.format(what="The picture")  # the same words, no path
    files.wrote(outside["secret"])  # a picture this server wrote may come back
    assert files.picture(outside["secret"], "The picture").size == (123, 45)


# ---- every event that takes a picture, called as an outsider ----------------------------------------------------


@pytest.mark.parametrize("meta", [False, True], ids=["plain path", "with Gradio's meta"])
def test_the_path_probe_is_answered_alike_at_every_event_that_takes_a_picture(page, outside, meta):
    demo, client = page
    doors = {
        "control picture preview": lambda p: predict(client, demo, "preview", [named(p, meta), False]),
        "PNG info drop": lambda p: predict(client, demo, "File", [named(p, meta)]),
        "history thumbnails": lambda p: predict(client, demo, "show_history", [[{"thumbnail": p, "seed": 1}]]),
        "control picture": lambda p: queued(client, demo, "generate", generate_values(named(p, meta)), "g1"),
        "mask": lambda p: queued(client, demo, "generate", generate_values(mask=named(p, meta), mode="Inpaint"), "g2"),
        "picture": lambda p: queued(
            client,
            demo,
            "generate",
            generate_values(picture={"background": named(p, meta), "layers": []}, mode="Image to image"),
            "g3",
        ),
        "reference picture": lambda p: queued(
            client, demo, "generate", generate_values(references=[{"image": named(p, meta)}], mode="Edit"), "g4"
        ),
    }
    for door, call in doors.items():
        answers = {kind: call(path) for kind, path in outside.items()}
        texts = {kind: json.dumps(answer) for kind, answer in answers.items()}
        for kind, path in outside.items():
            assert path not in texts[kind] and "root:x" not in texts[kind], (door, kind, texts[kind])
        if door != "history thumbnails":  # a refusal; the history shows a grey square for what it cannot read
            assert _refused(answers["secret"]), (door, texts["secret"])
        plain = {kind: _without_timings(answer) for kind, answer in answers.items()}
        assert plain["secret"] == plain["no picture"] == plain["missing"], (door, plain)


def _refused(answer) -> bool:
    return answer[0] != 200 if isinstance(answer, tuple) else "error" in answer


def _without_timings(answer) -> object:
    if isinstance(answer, tuple):  # (status, body) of run/predict
        status, body = answer
        payload = json.loads(body)
        return status, {k: v for k, v in payload.items() if "duration" not in k}
    return answer


def test_the_preview_event_was_a_door_before_the_check(page, outside):
    demo, client = page
    status, body = predict(client, demo, "preview", [named(outside["secret"], True), False])
    assert status != 200 and "123" not in body  # the secret picture never comes back, resized or not


def test_an_uploaded_picture_is_read_at_the_events_that_take_one(page):
    demo, client = page
    answer = client.post("/gradio_api/upload", files={"files": ("control.png", png(Image.new("RGB", (40, 30), "red")))})
    (path,) = answer.json()
    status, body = predict(client, demo, "preview", [named(path, True), False])
    assert status == 200 and json.loads(body)["data"][0]["path"], body


def test_history_entries_are_made_from_the_servers_own_pictures(page):
    demo, client = page
    status, body = predict(client, demo, "remember", [[], *FORM], session="tab-1")
    assert status == 200 and json.loads(body)["data"][0] == []  # nothing drawn in this tab: nothing to remember
    assert "error" not in queued(client, demo, "generate", generate_values(), "tab-1")
    status, body = predict(client, demo, "remember", [[], *FORM], session="tab-1")
    (entry,) = json.loads(body)["data"][0]
    assert entry["prompt"] == "a cat" and len(entry["thumbnail"]) > 100  # the server's thumbnail of its picture
    status, body = predict(client, demo, "remember", [[], *FORM], session="tab-2")
    assert json.loads(body)["data"][0] == []  # another tab's picture is not this one's
