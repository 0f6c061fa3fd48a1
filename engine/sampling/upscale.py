"""Pictures upscaled by a network (RRDBNet, SRVGGNetCompact) in tiles, or resampled by PIL (`Lanczos`, `Nearest`),
behind one call: `upscale(picture, scale, upscaler)`.

A network runs in f32 over tiles so that its memory stays bounded at any picture size. Each tile's core (`tile`
input pixels a side) is computed from a window `overlap` pixels wider on each side, and only the core is kept
(cropped, not blended): the window's zero padding sits where the picture's own edge is or `overlap` pixels away
from the core. With `overlap` at least the network's receptive radius (`config.receptive_radius`) the tiled result
is the whole picture's; with less, what the cut-off pixels contribute decays with their distance. Every window has
the same size (moved inward at the picture's edges), so one picture compiles one program.

As A1111's `Upscaler.upscale`: a network runs up to three times until the picture covers the target (once for a
1x restoration model at scale 1), then Lanczos brings it to the exact size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from ..errors import InvalidRequest

if TYPE_CHECKING:
    from ..loading.upscaler import LoadedUpscaler

RESAMPLERS = {"Lanczos": Image.Resampling.LANCZOS, "Nearest": Image.Resampling.NEAREST}
DEFAULT_TILE = 192  # input pixels a side of a tile's core (A1111's ESRGAN tile)
DEFAULT_OVERLAP = 16  # input pixels of context around each core
MAX_SIDE = 8192  # output pixels a side: an upscale past this is refused, not attempted
MAX_PIXELS = 8192 * 8192  # output pixels in all (192 MiB of RGB)
MODEL_PASSES = 3  # A1111's limit on a network's repeated runs toward a target


@partial(jax.jit, static_argnums=0)  # static: the network's graph (one program per upscaler and window size)
def _forward(graphdef: nnx.GraphDef, params: nnx.State, window: jax.Array) -> jax.Array:
    """window [1, h, w, c] in [0, 1] -> [1, h * scale, w * scale, c] as uint8, clipped and rounded as Real-ESRGAN."""
    out = nnx.merge(graphdef, params)(window)
    return jnp.round(jnp.clip(out, 0.0, 1.0) * 255.0).astype(jnp.uint8)


def spans(size: int, tile: int, overlap: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(window size, [(core start, core end, window start)]) along one side of `size` pixels: cores of `tile`
    pixels, each inside a window of `tile + 2 * overlap` (the whole side where that is larger), moved inward at the
    edges so that every window lies in the picture."""
    window = min(size, tile + 2 * overlap)
    cores = [(start, min(start + tile, size)) for start in range(0, size, tile)]
    return window, [(a, b, min(max(a - overlap, 0), size - window)) for a, b in cores]


Progress = Callable[[int, int], None]  # (tiles done, tiles in all), after each tile; raising from it stops the run


def run_network(
    upscaler: LoadedUpscaler,
    pixels: np.ndarray,
    tile: int = DEFAULT_TILE,
    overlap: int = DEFAULT_OVERLAP,
    progress: Progress | None = None,
) -> np.ndarray:
    """pixels [h, w, c] uint8 -> [h * scale, w * scale, c] uint8 through the network, tile by tile.

    A network that pixel-unshuffles its input (x2plus) reads the picture reflect-padded to a multiple of its
    factor, with tiles and overlaps on that grid, and its output is cropped back (spandrel's `pad_to_multiple`).
    """
    cfg, (h, w, c) = upscaler.config, pixels.shape
    if c != cfg.in_channels:
        raise InvalidRequest(f"upscaler {upscaler.name} reads {cfg.in_channels} channels, the picture has {c}")
    if tile < 1 or overlap < 0:
        raise InvalidRequest(f"tile must be at least 1 and overlap at least 0, not {tile} and {overlap}")
    grid = getattr(cfg, "shuffle_factor", 1)
    tile, overlap = -(-tile // grid) * grid, -(-overlap // grid) * grid
    padded = np.pad(pixels, ((0, -h % grid), (0, -w % grid), (0, 0)), mode="reflect" if min(h, w) > grid else "edge")
    x = padded.astype(np.float32) / 255.0  # [H, W, c]
    s, params = cfg.scale, jax.device_put(upscaler.params)  # one copy per picture, not per tile
    out = np.empty((x.shape[0] * s, x.shape[1] * s, cfg.out_channels), np.uint8)
    (win_h, rows), (win_w, cols) = spans(x.shape[0], tile, overlap), spans(x.shape[1], tile, overlap)
    for done, ((y0, y1, wy), (x0, x1, wx)) in enumerate(((row, col) for row in rows for col in cols), 1):
        window = jnp.asarray(x[None, wy : wy + win_h, wx : wx + win_w])
        result = np.asarray(_forward(upscaler.graphdef, params, window))[0]
        out[y0 * s : y1 * s, x0 * s : x1 * s] = result[(y0 - wy) * s : (y1 - wy) * s, (x0 - wx) * s : (x1 - wx) * s]
        if progress is not None:
            progress(done, len(rows) * len(cols))
    return out[: h * s, : w * s]


def check_size(
    width: int, height: int, max_side: int = MAX_SIDE, max_pixels: int = MAX_PIXELS, what: str | None = None
) -> None:
    """Refuses an output of more than `max_side` pixels a side or `max_pixels` in all, or of no pixels; `what` names
    a picture on the way to the output (a network's pass)."""
    what = what or f"an upscale to {width}x{height}"
    if width < 1 or height < 1:
        raise InvalidRequest(f"{what} has no pixels")
    if max(width, height) > max_side or width * height > max_pixels:
        raise InvalidRequest(
            f"{what} is over this server's limit of {max_side} pixels a side and "
            f"{max_pixels / 1e6:.0f} megapixels; ask for a smaller scale"
        )


def upscaler_name(upscaler: str | LoadedUpscaler) -> str:
    return upscaler if isinstance(upscaler, str) else upscaler.name


def upscale_to(
    picture: Image.Image | np.ndarray,
    width: int,
    height: int,
    upscaler: str | LoadedUpscaler,
    tile: int = DEFAULT_TILE,
    overlap: int = DEFAULT_OVERLAP,
    max_side: int = MAX_SIDE,
    max_pixels: int = MAX_PIXELS,
    progress: Progress | None = None,
) -> Image.Image | np.ndarray:
    """`picture` (PIL, or uint8 RGB [h, w, 3]) at width x height through `upscaler` ("Lanczos", "Nearest" or a
    loaded network); returned as it came (PIL or numpy). `progress` hears of each tile of each network pass."""
    check_size(width, height, max_side, max_pixels)
    as_array = isinstance(picture, np.ndarray)
    if as_array and (picture.dtype != np.uint8 or picture.ndim != 3 or picture.shape[2] != 3):
        raise InvalidRequest(f"a picture to upscale is uint8 RGB [h, w, 3], not {picture.dtype} {picture.shape}")
    image = Image.fromarray(picture) if as_array else picture.convert("RGB")
    if isinstance(upscaler, str):
        if upscaler not in RESAMPLERS:
            raise InvalidRequest(f"unknown upscaler {upscaler!r}; the resamplers are {', '.join(RESAMPLERS)}")
        image = image.resize((width, height), RESAMPLERS[upscaler])
    else:
        restoration = width == image.width and height == image.height
        for i in range(MODEL_PASSES):
            if image.width >= width and image.height >= height and (i > 0 or not restoration):
                break
            w, h = image.width * upscaler.scale, image.height * upscaler.scale
            check_size(w, h, max_side, max_pixels, f"upscaler {upscaler.name}'s {w}x{h} on the way to {width}x{height}")
            before = image.size
            image = Image.fromarray(run_network(upscaler, np.asarray(image), tile, overlap, progress))
            if image.size == before:
                break
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.LANCZOS)
    return np.asarray(image) if as_array else image


def upscale(
    picture: Image.Image | np.ndarray, scale: float, upscaler: str | LoadedUpscaler, **options
) -> Image.Image | np.ndarray:
    """`picture` scaled by `scale` along each side (rounded to whole pixels) through `upscaler`; `options` as
    `upscale_to`'s (tile, overlap, max_side, max_pixels, progress)."""
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise InvalidRequest(f"an upscale's scale must be a positive number, not {scale!r}")
    h, w = (picture.shape[:2]) if isinstance(picture, np.ndarray) else (picture.height, picture.width)
    return upscale_to(picture, round(w * scale), round(h * scale), upscaler, **options)
