"""AUTOMATIC1111's "Extras" over the engine's upscalers: `/sdapi/v1/upscalers`, `/latent-upscale-modes`,
`/extra-single-image` and `/extra-batch-images`, as A1111's `modules/api/api.py` and `scripts/postprocessing_upscale.py`
answer them.

- The upscalers are the engine's (`pipe.upscalers`: Lanczos, Nearest and the networks of `--upscalers DIR`), after
  A1111's "None" (no network: the picture resized with Lanczos). The latent ones serve hires fix only.
- `resize_mode` 0 scales by `upscaling_resize`; 1 resizes to `upscaling_resize_w` x `upscaling_resize_h`, cropping
  the middle when `upscaling_crop`; `upscaler_2` is blended over the first at `extras_upscaler_2_visibility`.
- One upscale runs at a time (it takes the CPUs the drawings use); up to `MAX_WAITING` more wait, the rest are told
  to come back (503), and a picture is checked by pixels before it is read, as every door checks it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

import engine

from .api_common import b64, decode_base64, opaque, png_bytes, read_picture

NONE = "None"
MAX_WAITING = 4  # upscales waiting for the one that runs; more are refused at once
MAX_FACTOR = 8.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ExtrasOptions(_Body):
    resize_mode: int = 0  # 0: by upscaling_resize; 1: to upscaling_resize_w x upscaling_resize_h
    upscaling_resize: float = 2.0
    upscaling_resize_w: int = 512
    upscaling_resize_h: int = 512
    upscaling_crop: bool = True
    upscaler_1: str = NONE
    upscaler_2: str = NONE
    extras_upscaler_2_visibility: float = 0.0
    show_extras_results: bool = True  # accepted: the results are always sent
    gfpgan_visibility: float = 0.0  # face restoration: not offered here, refused when asked for
    codeformer_visibility: float = 0.0


class ExtrasSingleImageRequest(ExtrasOptions):
    image: str = ""  # base64, with or without a data: prefix


class ImageData(_Body):
    data: str
    name: str = ""


class ExtrasBatchImagesRequest(ExtrasOptions):
    imageList: list[ImageData] = []  # noqa: N815 - A1111's field name


class ExtrasSingleImageResponse(BaseModel):
    html_info: str = Field(default="", description="what was done, as A1111's page shows it")
    image: str = Field(description="the upscaled picture, a base64 PNG")


class ExtrasBatchImagesResponse(BaseModel):
    html_info: str = ""
    images: list[str]


class UpscalerItem(BaseModel):
    name: str
    model_name: str | None = None
    model_path: str | None = None
    model_url: str | None = None
    scale: float | None = None


def _refuse(message: str) -> engine.InvalidRequest:
    return engine.InvalidRequest(message)


def upscaler_items(pipe: engine.EngineFace) -> list[UpscalerItem]:
    """A1111's list: "None", then the engine's resamplers and networks (with their scale); an engine that offers
    no upscalers lists none."""
    folder = getattr(pipe, "upscalers", None)
    if folder is None:
        return []
    names = folder.names()
    items = [UpscalerItem(name=NONE)]
    for name in names:
        entry = folder.entries.get(name)
        if entry is None:
            items.append(UpscalerItem(name=name))
        else:  # the file's name only: where the server keeps it is not a client's business
            items.append(
                UpscalerItem(name=name, model_name=entry.architecture, model_path=entry.path.name, scale=entry.scale)
            )
    return items


def target_size(options: ExtrasOptions, size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(the size to upscale to, the size to crop its middle to, or None)."""
    width, height = size
    if options.resize_mode == 0:
        factor = options.upscaling_resize
        if not 0 < factor <= MAX_FACTOR:
            raise _refuse(f"upscaling_resize must be above 0 and at most {MAX_FACTOR:g}, got {factor!r}")
        return (round(width * factor), round(height * factor)), None
    if options.resize_mode != 1:
        raise _refuse(f"resize_mode must be 0 (scale by upscaling_resize) or 1 (to a size), not {options.resize_mode}")
    w, h = options.upscaling_resize_w, options.upscaling_resize_h
    if w < 1 or h < 1:
        raise _refuse(f"upscaling_resize_w and upscaling_resize_h must be at least 1, got {w} and {h}")
    if not options.upscaling_crop:
        return (w, h), None
    scale = max(w / width, h / height)  # cover the size, then crop the middle
    return (round(width * scale), round(height * scale)), (w, h)


def _check(pipe: engine.EngineFace, options: ExtrasOptions) -> None:
    if options.gfpgan_visibility or options.codeformer_visibility:
        raise _refuse("face restoration (GFPGAN, CodeFormer) is not offered here; send their visibility as 0")
    offered = [NONE, *(getattr(pipe, "upscalers", None).names() if getattr(pipe, "upscalers", None) else [])]
    for name in (options.upscaler_1, options.upscaler_2):
        if name not in offered:
            raise _refuse(f"unknown upscaler {name!r}; this server offers: {', '.join(offered)}")
    if not 0 <= options.extras_upscaler_2_visibility <= 1:
        raise _refuse("extras_upscaler_2_visibility must be from 0 to 1")


def upscaled(pipe: engine.EngineFace, picture: Image.Image, options: ExtrasOptions) -> Image.Image:
    """The picture through upscaler_1 (and upscaler_2 blended over it), at the size `options` asks for."""
    size, crop = target_size(options, picture.size)
    first = pipe.upscale(picture, *size, options.upscaler_1 if options.upscaler_1 != NONE else "Lanczos")
    if options.upscaler_2 != NONE and options.extras_upscaler_2_visibility > 0:
        second = pipe.upscale(picture, *size, options.upscaler_2)
        first = Image.blend(first, second, options.extras_upscaler_2_visibility)
    if crop is not None:
        left, top = (first.width - crop[0]) // 2, (first.height - crop[1]) // 2
        first = first.crop((left, top, left + crop[0], top + crop[1]))
    return first


class Upscales:
    """One upscale at a time, `MAX_WAITING` more waiting."""

    def __init__(self, max_waiting: int = MAX_WAITING):
        self.max_waiting = max_waiting
        self._turn = asyncio.Lock()
        self._waiting = 0

    async def run(self, work, *args) -> Any:
        if self._waiting >= self.max_waiting:
            raise engine.Busy(f"{self._waiting} upscales are waiting already; try again in a moment")
        self._waiting += 1
        try:
            async with self._turn:
                return await asyncio.to_thread(work, *args)
        finally:
            self._waiting -= 1


def add_extras_routes(router: APIRouter, pipe: engine.EngineFace, max_pixels: int) -> None:
    """The Extras routes on A1111's router; `max_pixels`: a picture sent in over this many pixels is refused."""
    upscales = Upscales()

    def single(body: ExtrasSingleImageRequest) -> str:
        picture = opaque(read_picture(decode_base64(body.image, "image"), "image", max_pixels))
        return b64(png_bytes(upscaled(pipe, picture, body)))

    def batch(body: ExtrasBatchImagesRequest) -> list[str]:
        pictures = [
            opaque(read_picture(decode_base64(item.data, f"imageList[{k}]"), f"imageList[{k}]", max_pixels))
            for k, item in enumerate(body.imageList)
        ]
        return [b64(png_bytes(upscaled(pipe, picture, body))) for picture in pictures]

    @router.get("/upscalers", response_model=list[UpscalerItem])
    async def upscalers():
        return upscaler_items(pipe)

    @router.get("/latent-upscale-modes", response_model=list[dict[str, Any]])
    async def latent_upscale_modes():
        return [{"name": name} for name in getattr(pipe.limits, "upscalers", ()) if name.startswith("Latent")]

    @router.post("/extra-single-image", response_model=ExtrasSingleImageResponse)
    async def extra_single_image(body: ExtrasSingleImageRequest):
        _check(pipe, body)
        return ExtrasSingleImageResponse(image=await upscales.run(single, body))

    @router.post("/extra-batch-images", response_model=ExtrasBatchImagesResponse)
    async def extra_batch_images(body: ExtrasBatchImagesRequest):
        _check(pipe, body)
        if len(body.imageList) > 8:
            raise _refuse("extra-batch-images takes at most 8 pictures per request")
        return ExtrasBatchImagesResponse(images=await upscales.run(batch, body))
