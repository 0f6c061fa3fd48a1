"""Pictures from clients: which paths a client may name, and a picture's size and format checked before decoding.

Every door that opens a picture a client sent (the page's inputs, the REST uploads, the PNG-info drop, history
thumbnails) opens it here. `open_picture` reads the header only (Pillow opens lazily), refuses a format other
than PNG, JPEG or WebP and a picture over the pixel limit, and only then decodes the pixels. `ClientFiles` says
which paths a client may name: a file under Gradio's upload folder (where uploads and Gradio's cache live), or
a file this server wrote. Anything else is refused with one message, whatever the path, which is never echoed:
an existing secret, a file that is no picture and a missing one read alike.

The pictures this server writes (`ClientFiles.new_picture`) are deleted once `ttl_s` has passed, or once more
than `capacity` are remembered, and Gradio's copies of them in its cache with them, so the disk they take stays
bounded (the rest of Gradio's cache, the uploads, is swept on the same schedule: page.py's `delete_cache`).
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

from PIL import Image

import engine

FORMATS = ("PNG", "JPEG", "WEBP")  # what Pillow may open for a client: no EPS (Ghostscript), no exotic decoders
SIDE_FACTOR = 2  # the default limit: a picture up to twice the largest side the server draws, squared
NOT_OURS = "{what} is not a picture uploaded to this server: upload it first."
PICTURE_TTL_S = 3600  # a picture this server wrote is kept this long for the page to serve, then deleted


def default_max_pixels(limits: engine.Limits) -> int:
    """Pixels read at most per picture: the largest side the server draws, twice, squared."""
    return (SIDE_FACTOR * limits.max_side) ** 2


def _refuse(message: str) -> engine.InvalidRequest:
    return engine.InvalidRequest(message)


def open_picture(source: bytes | str | os.PathLike | IO[bytes], what: str, max_pixels: int) -> Image.Image:
    """A decoded picture, once its header says it is a PNG, JPEG or WebP of at most `max_pixels` pixels.
    Raises `engine.InvalidRequest` with a message for the user; nothing is decoded before the checks."""
    try:
        with warnings.catch_warnings():  # Pillow's own bomb warning: the limit below is the one that holds here
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes | bytearray) else source, formats=FORMATS)
    except Image.DecompressionBombError:
        raise _refuse(f"{what} is too large to read; at most {max_pixels} pixels are read") from None
    except (OSError, ValueError, SyntaxError):
        raise _refuse(f"{what} could not be read as a picture (send a PNG, JPEG or WebP file)") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise _refuse(f"{what} is {width}x{height} pixels; at most {max_pixels} pixels are read")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        image.close()
        raise _refuse(f"{what} is damaged: its pixels could not be read") from None
    return image


def _upload_folder() -> Path:
    from gradio.utils import get_upload_folder  # GRADIO_TEMP_DIR, else the system's temp folder / "gradio"

    return Path(get_upload_folder())


class ClientFiles:
    """The paths a client may name, and the pictures opened from them. `upload_folder`: Gradio's (default: as
    Gradio finds it); `capacity`: files this server wrote that are kept, the oldest deleted first; `ttl_s`: how long
    one is kept; `folder`: where they are written (default: the system's temp folder)."""

    def __init__(
        self,
        max_pixels: int,
        upload_folder: str | os.PathLike | None = None,
        capacity: int = 4096,
        ttl_s: float = PICTURE_TTL_S,
        folder: str | os.PathLike | None = None,
        clock=time.monotonic,
    ):
        self.max_pixels = max_pixels
        self.upload_folder = Path(upload_folder) if upload_folder is not None else _upload_folder()
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.folder = folder
        self.clock = clock
        self._written: OrderedDict[Path, float] = OrderedDict()  # path -> when written, the oldest first
        self._lock = threading.Lock()

    def new_picture(self, prefix: str = "") -> str:
        """A new empty .png file for a picture this server writes, noted as written (and deleted in its time)."""
        handle, path = tempfile.mkstemp(suffix=".png", prefix=prefix, dir=self.folder)
        os.close(handle)
        self.wrote(path)
        return path

    def wrote(self, path: str | os.PathLike) -> None:
        """Notes a file this server wrote (a picture it serves), so that a client may hand it back until it is
        deleted: after `ttl_s`, or when more than `capacity` are kept."""
        with self._lock:
            self._written[Path(path).resolve()] = self.clock()
            self._written.move_to_end(Path(path).resolve())
        self.sweep()

    def sweep(self) -> None:
        """Deletes the written files past their time, and the oldest beyond `capacity`."""
        with self._lock:
            now, gone = self.clock(), []
            while self._written:
                path, written = next(iter(self._written.items()))
                if len(self._written) <= self.capacity and now - written <= self.ttl_s:
                    break
                del self._written[path]
                gone.append(path)
        for path in gone:
            path.unlink(missing_ok=True)
        if gone:
            self._delete_copies({path.name for path in gone})

    def _delete_copies(self, names: set[str]) -> None:
        # Gradio serves a picture from its copy, under the file's name in a folder of the upload folder named by its
        # hash (and its own delete_cache misses those of an event's outputs); our names are unique (mkstemp's).
        try:
            folders = [entry for entry in os.scandir(self.upload_folder) if entry.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for folder in folders:
            for name in names:
                copy = Path(folder.path, name)
                if copy.is_file():
                    copy.unlink(missing_ok=True)
                    try:
                        Path(folder.path).rmdir()  # the folder Gradio made for it, once empty
                    except OSError:
                        pass

    def may_open(self, path: str | os.PathLike) -> bool:
        """Whether a client may name `path`: an existing file, after symlinks, under the upload folder or written here."""
        try:
            real = Path(path).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a NUL byte
            return False
        if not real.is_file():
            return False
        return real in self._written or real.is_relative_to(self.upload_folder.resolve())

    def picture(self, value: Any, what: str) -> Image.Image | None:
        """A picture a client sent: None, a PIL picture (from our own code), or Gradio's file data (a dict with a
        `path`) naming a file it may open. Raises `engine.InvalidRequest`; the path is never echoed."""
        if value is None or isinstance(value, Image.Image):
            return value
        path = value.get("path") if isinstance(value, dict) else value if isinstance(value, str) else None
        if not isinstance(path, str) or not path or not self.may_open(path):
            raise _refuse(NOT_OURS.format(what=what))
        return open_picture(path, what, self.max_pixels)

    def editor(self, value: Any, what: str) -> dict[str, Any] | Image.Image | None:
        """An image editor's value (background, painted layers) with each picture opened as `picture` opens it."""
        if not isinstance(value, dict) or ("background" not in value and "layers" not in value):
            return self.picture(value, what)
        layers = value.get("layers") or []
        if not isinstance(layers, list):
            raise _refuse(NOT_OURS.format(what=what))
        return {
            "background": self.picture(value.get("background"), what),
            "layers": [self.picture(layer, what) for layer in layers],
        }
