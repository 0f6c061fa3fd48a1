"""A picture and its mask made ready as AUTOMATIC1111 makes them for image to image and inpainting, and the drawing
pasted back over the picture afterwards. Read A1111's `StableDiffusionProcessingImg2Img.init`, `apply_overlay`
(modules/processing.py), `resize_image` (modules/images.py) and modules/masking.py for the original.

- `resize_picture`: A1111's resize modes: 0 just resize, 1 crop and resize (cover the size, cut the middle), 2
  resize and fill (fit inside, the edge rows or columns stretched over the bands left), 3 (A1111 resizes the
  latents) as 0 here, the picture resized before it is encoded.
- `blur_mask`: a Gaussian of sigma `mask_blur` over 2 * int(2.5 * sigma + 0.5) + 1 taps, along x then y, the edges
  mirrored without repeating the edge pixel, rounded to 8 bits after each pass (OpenCV's `GaussianBlur`, which A1111
  calls).
- `masked_area`: "only masked" (`inpaint_full_res`): the mask's bounding box grown by the padding, then widened or
  heightened to the request's aspect inside the picture; the crop is drawn at the request's size. An empty mask has
  no box: the whole picture is drawn at the request's size with nothing repainted (A1111 then draws it as image to
  image without a mask, which a model that only inpaints cannot).
- `fill_masked`: "fill" (`inpainting_fill` 0): the masked part painted with the kept colours blurred ever less
  (radii 256 down to 0), so the drawing starts from the colours around the hole.
- `overlay` / `paste_back`: the picture where it is kept (its alpha: the blurred mask inverted) laid over the drawing,
  which "only masked" first pastes into its box of the whole picture.

Latent noise and latent nothing (`inpainting_fill` 2 and 3) change the starting latents: `modes.start`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter, ImageOps

FILL_LAYERS = ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1))  # (blur radius, times laid on), widest first
LANCZOS = Image.Resampling.LANCZOS


def resize_picture(image: Image.Image, width: int, height: int, mode: int) -> Image.Image:
    """`image` at width x height by A1111's resize mode (see the module docstring); the mode is kept."""
    if mode in (0, 3):
        return image.resize((width, height), LANCZOS)
    ratio, own = width / height, image.width / image.height
    if mode == 1:  # cover: the size sets the side along which the picture is relatively narrower
        w = width if ratio > own else image.width * height // image.height
        h = height if ratio <= own else image.height * width // image.width
    else:  # fit: the size sets the side along which the picture is relatively wider
        w = width if ratio < own else image.width * height // image.height
        h = height if ratio >= own else image.height * width // image.width
    scaled = image.resize((w, h), LANCZOS)
    out = Image.new(image.mode, (width, height))
    left, top = width // 2 - w // 2, height // 2 - h // 2
    out.paste(scaled, (left, top))
    if mode == 2 and ratio < own and top > 0:  # bands above and below: the first and last rows stretched
        out.paste(scaled.resize((width, top), box=(0, 0, width, 0)), (0, 0))
        out.paste(scaled.resize((width, top), box=(0, h, width, h)), (0, top + h))
    elif mode == 2 and ratio > own and left > 0:  # bands left and right: the first and last columns
        out.paste(scaled.resize((left, height), box=(0, 0, 0, height)), (0, 0))
        out.paste(scaled.resize((left, height), box=(w, 0, w, height)), (left + w, 0))
    return out


def _gaussian_matrix(size: int, sigma: float) -> np.ndarray:
    """[size, size]: one axis of OpenCV's Gaussian blur with BORDER_REFLECT_101 as a matrix (out = M @ in)."""
    taps = 2 * int(2.5 * sigma + 0.5) + 1
    offsets = np.arange(taps) - taps // 2
    weights = np.exp(-(offsets**2) / (2.0 * sigma * sigma))
    weights /= weights.sum()
    matrix = np.zeros((size, size))
    rows = np.arange(size)[:, None]
    source = rows + offsets[None, :]
    period = max(2 * size - 2, 1)  # reflect-101: ... 2 1 | 0 1 2 ... n-1 | n-2 ...
    source = np.abs(np.mod(source, period))
    source = np.where(source >= size, period - source, source)
    np.add.at(matrix, (np.broadcast_to(rows, source.shape), source), np.broadcast_to(weights, source.shape))
    return matrix


def blur_mask(mask: Image.Image, sigma: int) -> Image.Image:
    """A grey mask blurred as A1111's `mask_blur` blurs it (module docstring); 0: as it is."""
    if sigma <= 0:
        return mask
    pixels = np.asarray(mask.convert("L"), np.float64)  # [H, W]
    pixels = np.round(pixels @ _gaussian_matrix(mask.width, sigma).T).clip(0, 255)  # along x
    pixels = np.round(_gaussian_matrix(mask.height, sigma) @ pixels).clip(0, 255)  # then along y
    return Image.fromarray(pixels.astype(np.uint8))


def masked_area(mask: Image.Image, padding: int, width: int, height: int) -> tuple[int, int, int, int] | None:
    """(x1, y1, x2, y2): the box "only masked" draws, at the aspect of width x height; None for an empty mask."""
    box = mask.getbbox()
    if box is None:
        return None
    x1, y1, x2, y2 = box
    x1, y1, x2, y2 = (
        max(x1 - padding, 0),
        max(y1 - padding, 0),
        min(x2 + padding, mask.width),
        min(y2 + padding, mask.height),
    )
    if (x2 - x1) / (y2 - y1) > width / height:  # too wide for the request: grow it downwards and upwards
        y1, y2 = _grown(y1, y2, int((x2 - x1) * height / width - (y2 - y1)), mask.height)
    else:
        x1, x2 = _grown(x1, x2, int((y2 - y1) * width / height - (x2 - x1)), mask.width)
    return x1, y1, x2, y2


def _grown(low: int, high: int, more: int, limit: int) -> tuple[int, int]:
    """A span grown by `more`, half on each side, shifted back inside [0, limit] and cut there if still larger."""
    low, high = low - more // 2, high + more - more // 2
    if high >= limit:
        low, high = low - (high - limit), limit
    if low < 0:
        low, high = 0, high - low
    return low, min(high, limit)


def fill_masked(image: Image.Image, mask: Image.Image) -> Image.Image:
    """The picture with its masked part painted from the kept colours around it (`inpainting_fill` 0)."""
    kept = _kept(image, mask)
    out = Image.new("RGBA", image.size)
    for radius, times in FILL_LAYERS:
        layer = kept.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(times):
            out.alpha_composite(layer)
    return out.convert("RGB")


def _kept(image: Image.Image, mask: Image.Image) -> Image.Image:
    """The picture where the mask keeps it, transparent where it repaints, premultiplied ("RGBa")."""
    kept = Image.new("RGBa", image.size)
    kept.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    return kept


def overlay(image: Image.Image, mask: Image.Image) -> Image.Image:
    """What is laid over the drawing: the picture, opaque where it is kept, transparent where it is repainted."""
    return _kept(image, mask).convert("RGBA")


def paste_back(drawn: Image.Image, layer: Image.Image, box: tuple[int, int, int, int] | None) -> Image.Image:
    """The drawing with `layer` (`overlay`) over it; "only masked": first scaled into its box of the picture."""
    if box is not None:
        x1, y1, x2, y2 = box
        whole = Image.new("RGBA", layer.size)
        whole.paste(resize_picture(drawn, x2 - x1, y2 - y1, 1), (x1, y1))
        drawn = whole
    drawn = drawn.convert("RGBA")
    drawn.alpha_composite(layer)
    return drawn.convert("RGB")


@dataclass(frozen=True)
class Prepared:
    """What the drawing starts from, at the request's size, and what is laid over it after."""

    image: Image.Image  # RGB at width x height: what the VAE encodes
    mask: Image.Image | None  # L at width x height: white is repainted (the engine binarises it)
    layer: Image.Image | None = None  # RGBA at the result's size: `overlay`, laid over the drawing (None: nothing)
    box: tuple[int, int, int, int] | None = None  # "only masked": where the drawing goes in the picture

    def finish(self, drawn: Image.Image) -> Image.Image:
        return drawn if self.layer is None else paste_back(drawn, self.layer, self.box)


def prepare(
    image: Image.Image,
    mask: Image.Image | None,
    width: int,
    height: int,
    resize_mode: int = 0,
    mask_blur: int | None = None,
    inpaint_full_res: bool = False,
    padding: int = 0,
    inpainting_fill: int = 1,
) -> Prepared:
    """A1111's img2img preparation. `mask_blur` None and not `inpaint_full_res`: the drawing is not laid under the
    picture (diffusers' way); a number (0 too): the picture is laid over it through the mask blurred so much."""
    image = image.convert("RGB")
    if mask is None:
        return Prepared(resize_picture(image, width, height, resize_mode), None)
    mask = blur_mask(mask.convert("L"), mask_blur or 0)
    box = masked_area(mask, padding, width, height) if inpaint_full_res else None
    if box is not None:  # the box, drawn at the request's size; the result is the whole picture
        layer = overlay(image, mask)
        image, mask = (resize_picture(p.crop(box), width, height, 2) for p in (image, mask))
    else:  # an empty mask under "only masked" too: A1111 then draws the whole picture
        image, mask = (resize_picture(p, width, height, resize_mode) for p in (image, mask))
        doubled = Image.fromarray(np.minimum(np.asarray(mask, np.uint16) * 2, 255).astype(np.uint8))
        layer = overlay(image, doubled)  # the blur's inner half repainted whole, its outer half blended
    if mask_blur is None and not inpaint_full_res:
        layer = None
    if inpainting_fill != 1:  # A1111 fills the picture for the latent starts too (the VAE sees around the hole)
        image = fill_masked(image, mask)
    return Prepared(image, mask, layer, box)
