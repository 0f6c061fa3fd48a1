"""Reference pictures (`GenerationRequest.references`, for a model that edits): the size each is drawn at, the size a
request that gives none takes from them, and what `Limits.check` refuses. The family's `Denoiser.references` says
how many a model takes and how it sizes them; `Limits` carries that here.

The sizes are a static part of the plan, so each new combination compiles one. Where the server offers any size
(`Limits.sizes` None, local use) a reference is drawn exactly as the family's diffusers pipeline draws it. On a server
with fixed sizes it is drawn at one of `reference_shapes` (the offered sizes under the family's area rule, or the
family's own list), the nearest by aspect, then area, and resized to it (`fit_reference`): a stranger's pictures of
ever-new sizes can then make no more plans than those shapes allow."""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from .errors import InvalidRequest

# What these functions take: `request.Limits` (its reference fields, sides and sizes) and `request.GenerationRequest`,
# which import this module (it sits below them), so they are named here and not imported.
Limits = GenerationRequest = Any

# The smallest side and the widest aspect a reference picture may have (Flux2ImageProcessor.check_image_input's)
REFERENCE_MIN_SIDE, REFERENCE_MAX_ASPECT = 64, 8.0


def reference_size(limits: Limits, picture: Image.Image) -> tuple[int, int]:
    """(width, height) a reference picture is drawn at: shrunk to `limits.reference_pixels` when larger (each side times
    the square root of the areas' ratio, truncated: Flux2ImageProcessor's `_resize_to_target_area`), then each side
    rounded down to `limits.side_multiple` (the family's `prepare` keeps the middle). With `reference_resolutions`,
    the one nearest the picture's aspect instead (`nearest_resolution`). On a server with fixed sizes and no such
    list, the nearest of `reference_shapes` to that size (`nearest_shape`): not diffusers' size, a bounded set."""
    w, h = picture.size
    if limits.reference_resolutions:
        w, h = nearest_resolution(w, h, limits.reference_resolutions, limits.side_multiple)
    else:
        w, h = within_area(w, h, limits.reference_pixels)
        if limits.sizes is not None:
            return nearest_shape(w, h, reference_shapes(limits), limits.side_multiple)
    m = limits.side_multiple
    return w // m * m, h // m * m


def within_area(width: int, height: int, pixels: int) -> tuple[int, int]:
    """A width x height picture shrunk to about `pixels` when larger, each side times the square root of the areas'
    ratio, truncated (Flux2ImageProcessor's `_resize_to_target_area`); unchanged when not larger."""
    if width * height <= pixels:
        return width, height
    scale = math.sqrt(pixels / (width * height))
    return int(width * scale), int(height * scale)


def nearest_resolution(
    width: int, height: int, resolutions: tuple[tuple[int, int], ...], multiple: int
) -> tuple[int, int]:
    """The (width, height) of `resolutions` nearest in aspect to a width x height picture, as FluxKontextPipeline's
    `_auto_resize` picks it: the aspect of the picture's sides floored to `multiple` (its image processor's
    `get_default_height_width`), the first of the closest in (difference, width, height) order, floored too. A side
    under `multiple` counts as `multiple` (the pipeline divides by zero; `Limits.check` refuses such a picture)."""
    w, h = (max(side - side % multiple, multiple) for side in (width, height))
    _, w, h = min((abs(w / h - rw / rh), rw, rh) for rw, rh in resolutions)
    return w // multiple * multiple, h // multiple * multiple


def reference_shapes(limits: Limits) -> tuple[tuple[int, int], ...]:
    """The (width, height) shapes a reference can be drawn at on this server, or () where any size diffusers' rule
    gives goes (sizes not fixed, no list of the family's own). The family's list (`reference_resolutions`, FLUX.1
    Kontext's preferred resolutions) when it has one; on a server with fixed sizes, each offered size under the
    family's area rule (`within_area` of `reference_pixels`, sides floored to `side_multiple`). So there are at most
    `len(limits.sizes)` (or the list's length), and a request with k references at most that to the k plans."""
    if limits.reference_resolutions:
        return tuple(limits.reference_resolutions)
    if limits.sizes is None:
        return ()
    m = limits.side_multiple
    shrunk = (within_area(w, h, limits.reference_pixels) for w, h in limits.sizes)
    return tuple(dict.fromkeys((w // m * m, h // m * m) for w, h in shrunk))


def nearest_shape(width: int, height: int, shapes: tuple[tuple[int, int], ...], multiple: int) -> tuple[int, int]:
    """The one of `shapes` nearest a width x height picture: in aspect as `nearest_resolution` measures it (the
    picture's sides floored to `multiple`, the difference of width / height), then in area, then the narrower."""
    w, h = (max(side - side % multiple, multiple) for side in (width, height))
    return min(shapes, key=lambda s: (abs(w / h - s[0] / s[1]), abs(s[0] * s[1] - w * h), s))


def fit_reference(limits: Limits, picture: Image.Image, width: int, height: int) -> Image.Image:
    """The picture the family's `References.prepare` receives to draw at width x height: itself where references are
    drawn by the family's own rule, and resized by Lanczos to width x height on a server whose fixed sizes give the
    shapes (`reference_shapes` without `reference_resolutions`), where diffusers' own crop would not reach them; the
    family's crop or resize of a picture already that size then changes nothing."""
    if limits.sizes is None or limits.reference_resolutions or picture.size == (width, height):
        return picture
    return picture.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)


def reference_fill(limits: Limits, r: GenerationRequest) -> dict:
    """`resolve`'s part for references: a list (or None) becomes a tuple, and a request that gives no size (and no
    picture to start from) takes its first reference's, as Flux2KleinPipeline does (a fixed size: the nearest)."""
    fill = {}
    if r.references is None or isinstance(r.references, list):
        fill["references"] = tuple(r.references or ())
    refs = fill.get("references", r.references)
    if not (limits.max_references and isinstance(refs, tuple) and refs and isinstance(refs[0], Image.Image)):
        return fill
    if r.image is None and r.height is None and r.width is None:
        w, h = (max(limits.min_side, side) for side in reference_size(limits, refs[0]))
        if limits.sizes is not None and (w, h) not in limits.sizes:
            w, h = limits.image_size(Image.new("1", (w, h)))
        fill["width"], fill["height"] = w, h
    return fill


def check_references(limits: Limits, r: GenerationRequest) -> None:
    """Reference pictures: only for a model that edits, at most `max_references`, each a picture of a size the
    family's pipeline takes."""
    refs = r.references
    if limits.min_references and (
        refs is None or (isinstance(refs, (tuple, list)) and len(refs) < limits.min_references)
    ):
        what = "the picture to edit" if limits.min_references == 1 else f"at least {limits.min_references} pictures"
        raise InvalidRequest(f"this model edits a picture as the prompt says: send {what} in references")
    if refs is None or (isinstance(refs, (tuple, list)) and not refs):
        return
    if limits.max_references == 0:
        raise InvalidRequest("this model does not take reference pictures (it does not edit); send no references")
    if not isinstance(refs, (tuple, list)):
        raise InvalidRequest(f"references must be a list of pictures, got {type(refs).__name__}")
    if len(refs) > limits.max_references:
        raise InvalidRequest(
            f"{len(refs)} reference pictures are too many; this model takes at most {limits.max_references}"
        )
    low, wide = REFERENCE_MIN_SIDE, REFERENCE_MAX_ASPECT
    for k, picture in enumerate(refs, 1):
        if not isinstance(picture, Image.Image):
            raise InvalidRequest(f"reference {k} must be a picture (PIL.Image), got {type(picture).__name__}")
        w, h = picture.size
        if min(w, h) < low or max(w / h, h / w) > wide:
            raise InvalidRequest(
                f"reference {k} is {w}x{h}; a reference picture needs sides of at least {low} pixels and an "
                f"aspect of at most {wide:g}:1"
            )
    if r.hires:
        raise InvalidRequest("hires fix does not carry reference pictures to its second pass; send hires_scale 0")
