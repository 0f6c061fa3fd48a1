"""A picture sent in is checked from its header, before its pixels are decoded, at every door that opens one.

The probe is a real 13000x13000 PNG of under half a megabyte (one colour; 507 MB once decoded, under Pillow's own
179 MP guard): the page's inputs, the REST uploads, the PNG-info drop and the history's thumbnails refuse it
without decoding it. Only PNG, JPEG and WebP are opened. Over the stand-in engine, in-process.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageFile

import engine
from engine.compat.pnginfo import png_info
from tests._api_server import FakeEngine, b64png, fake_app, png
from web import handlers
from web.pictures import ClientFiles, default_max_pixels, open_picture

SIDE = 13000
REST = {"prompt": "a cat", "seed": 1, "steps": 2}


def solid_png(side: int, rows_per_block: int = 10) -> bytes:
    """A black side x side RGB PNG, built without ever holding its pixels: one deflate block of rows, compressed
    once and repeated (a full flush makes each one stand alone), then an empty final block."""
    block = b"\0" * ((1 + 3 * side) * rows_per_block)  # each row: filter byte 0, then black pixels
    compressor = zlib.compressobj(9)
    first = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    length = len(block) * (side // rows_per_block)
    adler = (length % 65521) << 16 | 1  # Adler-32 of zeros: A stays 1, B adds it once a byte
    data = first + again * (side // rows_per_block - 1) + b"\x03\x00" + struct.pack(">I", adler)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def huge() -> bytes:
    data = solid_png(SIDE)
    assert len(data) < 600_000 and Image.open(io.BytesIO(data)).size == (SIDE, SIDE)
    return data


@pytest.fixture
def never_decoded(monkeypatch):
    """Fails the test if any picture's pixels are decoded while it runs."""

    def load(self):
        raise AssertionError(f"decoded a {self.size} picture")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_the_solid_png_is_a_real_picture():
    picture = Image.open(io.BytesIO(solid_png(40)))
    picture.load()
    assert picture.size == (40, 40) and picture.getextrema() == ((0, 0), (0, 0), (0, 0))


def test_the_limit_is_twice_the_largest_side_squared():
    assert default_max_pixels(FakeEngine.limits) == (2 * 1024) ** 2


def test_a_huge_picture_is_refused_at_every_door_before_it_is_decoded(huge, tmp_path, never_decoded):
    before = resident_mb()
    limit = default_max_pixels(FakeEngine.limits)
    said = f"is {SIDE}x{SIDE} pixels; at most {limit} pixels are read"
    with pytest.raises(engine.InvalidRequest, match=said):
        open_picture(huge, "The picture", limit)
    (tmp_path / "huge.png").write_bytes(huge)
    files = ClientFiles(limit, upload_folder=tmp_path)  # as if it were uploaded to the page
    for value in ({"path": str(tmp_path / "huge.png")}, {"background": {"path": str(tmp_path / "huge.png")}}):
        with pytest.raises(engine.InvalidRequest, match=said):
            files.editor(value, "The picture")
    with pytest.raises(engine.InvalidRequest, match=said):
        handlers.read_png_info(FakeEngine(), str(tmp_path / "huge.png"), files)  # the PNG-info drop
    with pytest.raises(ValueError, match="at most"):
        png_info(huge)
    (shown, caption), *_ = handlers.show_history([{"thumbnail": base64.b64encode(huge).decode(), "seed": 3}])
    assert shown.size == (handlers.THUMBNAIL_SIDE,) * 2 and caption == "seed 3"  # a grey square in its place
    with TestClient(fake_app(FakeEngine())) as client:
        answer = client.post("/sdapi/v1/img2img", json={**REST, "init_images": [base64.b64encode(huge).decode()]})
        assert answer.status_code == 422 and said in answer.json()["detail"]
        answer = client.post("/v1/images/edits", data={"prompt": "a cat"}, files={"image": ("in.png", huge)})
        assert answer.status_code == 400 and said in answer.json()["error"]["message"]
    assert resident_mb() - before < 300


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n", id="EPS (Ghostscript)"),
        pytest.param("GIF", id="GIF"),
        pytest.param("BMP", id="BMP"),
    ],
)
def test_only_png_jpeg_and_webp_are_opened(data):
    if isinstance(data, str):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buffer, format=data)
        data = buffer.getvalue()
    with pytest.raises(engine.InvalidRequest, match="send a PNG, JPEG or WebP"):
        open_picture(data, "The picture", 10**6)
    for kind in ("PNG", "JPEG", "WEBP"):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buffer, format=kind)
        assert open_picture(buffer.getvalue(), "The picture", 64).size == (8, 8)


def test_the_server_option_sets_the_limit_for_every_door_and_caps_the_pages_uploads():
    app = fake_app(FakeEngine(), max_picture_pixels=1000, max_body_mb=2)
    assert app.state.demo.max_file_size == 2 * 2**20
    with TestClient(app) as client:
        picture = b64png(Image.new("RGB", (64, 64)))  # 4096 pixels: over this server's 1000
        answer = client.post("/sdapi/v1/img2img", json={**REST, "init_images": [picture]})
        assert answer.status_code == 422 and "is 64x64 pixels; at most 1000" in answer.json()["detail"]
        small = png(Image.new("RGB", (64, 64)))
        answer = client.post("/v1/images/edits", data={"prompt": "a cat"}, files={"image": ("in.png", small)})
        assert answer.status_code == 400 and "at most 1000" in answer.json()["error"]["message"]
