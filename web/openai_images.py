"""OpenAI's Images API (`/v1/images/generations`, `/v1/images/edits`) over the engine, for the `openai` client,
Open WebUI's and LibreChat's "OpenAI" image engines and whatever else speaks it.

- `model`: on a server of several models (`--models DIR`) one of those `/v1/models` lists (a title, name or hash as
  A1111's /sd-models gives them; an unknown one is refused with the names offered); OpenAI's own names ("dall-e-3",
  "gpt-image-1", ...) and none draw with the default. On a server of one model any name draws with it.
- `output_format`: "png" (the default; the picture carries its recipe), "jpeg" or "webp", at `output_compression`
  (0-100, default 100). `quality` and `style` are accepted and change nothing (the model's steps and guidance are
  ours to set: `num_inference_steps`, `guidance_scale`); `background` "auto" or "opaque" (every picture is), and
  "transparent" is refused by name.
- `size` is "WIDTHxHEIGHT" (a size the server does not offer is refused with the list), or "auto" / none for
  the model's own; `n` pictures get seeds seed, seed+1, ...
- Our request's own names ride along as extra body fields: `negative_prompt`, `seed`, `num_inference_steps`,
  `guidance_scale`, `scheduler` (our kinds, "euler_a", or A1111's sampler names), `clip_skip`, `eta`,
  `deep_cache` (a whole UNet pass every that many steps, the first level alone between), `token_merging` (the
  share of the first level's tokens merged before its self-attentions), and for edits `strength`. With the `openai` client: `extra_body={"seed": 5}`.
- `response_format`: "b64_json" (the default, as gpt-image models answer) or "url": a link to the PNG on this
  server, kept for `LINK_TTL_S` (at most `LINK_MAX_BYTES` of them; the oldest go first).
- `edits` (multipart): for a model that edits from reference pictures (FLUX.2 [klein], FLUX.1 Kontext), every
  `image` / `image[]` part is one, in order (up to the model's `max_references`; gpt-image-1 takes several too), with
  no mask and no `strength`, and the picture takes the first one's size unless `size` says another. For any other
  model one `image`, and an optional `mask` in OpenAI's convention (transparent pixels are redrawn): with a mask it is
  inpainting, without one image-to-image.
- Errors come in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (api_gate.py).
"""

from __future__ import annotations

import asyncio
import functools
import io
import re
import secrets
import time
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from PIL import Image
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

import engine
from engine import request_fields

from . import names
from .api_common import ApiJobs, b64, opaque, read_picture, read_references, reference_count, result_pngs
from .api_gate import ApiError, internal_error
from .pictures import default_max_pixels
from .requests import api_request

LINK_TTL_S = 600.0
LINK_MAX_BYTES = 128 * 2**20
FORMATS = ("b64_json", "url")
OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}  # OpenAI's name -> PIL's


def encoded(png: bytes, output_format: str, compression: int) -> bytes:
    """The picture as OpenAI's `output_format` asks: the PNG as it is (with its recipe), or JPEG / WebP."""
    if output_format == "png":
        return png
    buffer = io.BytesIO()
    with Image.open(io.BytesIO(png)) as image:
        image.convert("RGB").save(buffer, format=OUTPUT_FORMATS[output_format], quality=compression)
    return buffer.getvalue()


def _check_output(body: BaseModel) -> tuple[str, int]:
    output_format = (body.output_format or "png").lower()
    if output_format not in OUTPUT_FORMATS:
        formats = ", ".join(OUTPUT_FORMATS)
        raise ApiError(400, f"output_format must be one of {formats}", code="invalid_value", param="output_format")
    compression = 100 if body.output_compression is None else body.output_compression
    if not 0 <= compression <= 100:
        raise ApiError(
            400, "output_compression must be from 0 to 100", code="invalid_value", param="output_compression"
        )
    if (body.background or "auto").lower() not in ("auto", "opaque"):
        raise ApiError(400, "background must be auto or opaque: pictures here have no transparency", param="background")
    return output_format, compression


class _GenerationsOwn(BaseModel):
    """OpenAI's fields that jax-sd reads, then ours; every other field (quality, style, user, ...) is ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    n: int | None = 1
    size: str | None = None
    response_format: str | None = None
    model: str | None = None
    output_format: str | None = None  # "png", "jpeg" or "webp"
    output_compression: int | None = None  # 0-100, for jpeg and webp
    quality: str | None = None  # accepted, changes nothing
    style: str | None = None  # accepted, changes nothing
    background: str | None = None  # "auto" or "opaque"; "transparent" is refused


# The request fields OpenAI's door reads its own way: the prompt (its `<lora:...>` tags), `size`, `n`.
OWN_FIELDS = ("prompt", "width", "height", "num_images", "lora_scales", "image", "mask_image")


@functools.cache
def _body_models(fields: tuple) -> tuple[type[BaseModel], type[BaseModel]]:
    def extras(pictures: bool) -> dict[str, Any]:  # each field with an OpenAI name, as its type or null
        return {
            f.openai: (f.type | None, None)
            for f in fields
            if f.openai and f.name not in OWN_FIELDS and f.needs_image == pictures
        }

    doc = _GenerationsOwn.__doc__
    generations = create_model("GenerationsBody", __base__=_GenerationsOwn, __doc__=doc, **extras(False))
    edits = create_model("EditsBody", __base__=generations, **extras(True))
    return generations, edits


def body_models() -> tuple[type[BaseModel], type[BaseModel]]:
    """(GenerationsBody, EditsBody) for the request fields as they stand (`request_fields.current()`)."""
    return _body_models(request_fields.current())


GenerationsBody, EditsBody = body_models()


def body_values(pipe: engine.EngineFace, body: BaseModel) -> dict[str, Any]:
    """The request fields under their OpenAI names in the body, as ours (the scheduler read as names.py reads it)."""
    values = {
        f.name: getattr(body, f.openai)
        for f in request_fields.current()
        if f.openai and f.name not in OWN_FIELDS and hasattr(body, f.openai)
    }
    if "scheduler" in values:
        values["scheduler"] = names.our_scheduler(pipe, values["scheduler"])
    return values


OPENAI_MODELS = re.compile(r"^(dall-e-\d|gpt-image-[\w.-]+)$")  # OpenAI's own names: the server's default model


def model_choice(pipe: engine.EngineFace, name: str | None) -> str | None:
    """The request's `model`: on a server of several, the title of the one named (refused by name if none is);
    None for OpenAI's own model names, none at all, or a server of one model (which draws whatever is named)."""
    served = getattr(pipe, "models", None)
    if served is None or not name or OPENAI_MODELS.match(str(name).strip()):
        return None
    return served.match(str(name))


class PictureLinks:
    """The PNGs behind `response_format=url`, each under an unguessable name for a while."""

    def __init__(self, ttl_s: float = LINK_TTL_S, max_bytes: int = LINK_MAX_BYTES):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._files: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._files and (
            next(iter(self._files.values()))[0] < now or sum(len(d) for _, d in self._files.values()) > self.max_bytes
        ):
            self._files.popitem(last=False)

    def add(self, png: bytes, output_format: str = "png") -> str:
        name = f"{secrets.token_urlsafe(24)}.{output_format}"
        self._files[name] = (time.monotonic() + self.ttl_s, png)
        self._expire()
        return name

    def get(self, name: str) -> bytes | None:
        self._expire()
        entry = self._files.get(name)
        return entry[1] if entry else None


def _edit_pictures(
    pipe: engine.EngineFace, body: BaseModel, images: list[bytes], mask: bytes | None, max_pixels: int
) -> dict[str, Any]:
    """The request's pictures from an edit's parts: every image a reference for a model that edits, else the one
    picture to draw from and its mask."""
    if reference_count(pipe)[1]:
        if mask is not None:
            raise ApiError(400, "this model edits from the pictures alone and takes no mask; send none", param="mask")
        if getattr(body, "strength", None) is not None:
            raise ApiError(
                400,
                "strength is image to image's; this model edits from the pictures as they are, send none",
                param="strength",
            )
        return {"references": read_references(pipe, images, "image", max_pixels)}
    if len(images) != 1:
        raise ApiError(
            400,
            "send exactly one picture to edit, as the multipart file field image (this model edits one picture)",
            param="image",
        )
    picture = read_picture(images[0], "image", max_pixels)
    fields: dict[str, Any] = {"image": opaque(picture)}
    if mask is not None:
        drawn = read_picture(mask, "mask", max_pixels)
        if "A" not in drawn.getbands() and "transparency" not in drawn.info:
            raise engine.InvalidRequest(
                "mask must be a PNG with an alpha channel: its transparent pixels mark what to redraw"
            )
        alpha = drawn.convert("RGBA").getchannel("A")
        fields["mask_image"] = alpha.point(lambda a: 255 if a < 128 else 0)
    return fields


async def draw(
    pipe: engine.EngineFace, jobs: ApiJobs, links: PictureLinks, http: Request, body: BaseModel, pictures=None
) -> dict[str, Any]:
    response_format = body.response_format or "b64_json"
    if response_format not in FORMATS:
        raise ApiError(
            400, f"response_format must be one of {', '.join(FORMATS)}", code="invalid_value", param="response_format"
        )
    if not body.prompt.strip():
        raise ApiError(400, "prompt must not be empty", code="invalid_value", param="prompt")
    output_format, compression = _check_output(body)
    prompt, loras = names.take_loras(body.prompt)
    width, height = names.openai_size(body.size)
    request = api_request(
        prompt,
        width=width,
        height=height,
        num_images=1 if body.n is None else body.n,
        lora_scales=loras,
        model=model_choice(pipe, body.model),
        **body_values(pipe, body),
        **(pictures or {}),
    )
    job = await jobs.run(pipe, request, http)
    if isinstance(job.error, engine.Cancelled):
        raise ApiError(409, "the request was stopped before it finished", code="cancelled")
    if isinstance(job.error, engine.InvalidRequest):
        raise job.error
    if job.error is not None:
        raise internal_error(job.error, "OpenAI API")
    pngs = await asyncio.to_thread(result_pngs, job.result, pipe.model_name)
    kept = [encoded(png, output_format, compression) for png, _, withheld in pngs if not withheld]
    if not kept:
        raise ApiError(
            400,
            "the safety checker withheld every picture; try another prompt or seed",
            code="content_policy_violation",
        )
    revised = {"revised_prompt": prompt} if prompt != body.prompt else {}
    if response_format == "url":
        data = [
            {"url": str(http.url_for("openai_image_file", name=links.add(png, output_format))), **revised}
            for png in kept
        ]
    else:
        data = [{"b64_json": b64(png), **revised} for png in kept]
    r = job.result.request or job.request
    size = f"{r.width}x{r.height}"
    return {"created": int(time.time()), "data": data, "output_format": output_format, "size": size}


async def _read_edit_form(http: Request, model: type[BaseModel]) -> tuple[BaseModel, list[bytes], bytes | None]:
    """The body's fields, its pictures' bytes (the `image` and `image[]` parts, in order) and its mask's."""
    form = await http.form()
    try:
        images = [v for k, v in form.multi_items() if k in ("image", "image[]") and not isinstance(v, str)]
        if not images:
            raise ApiError(400, "send the picture to edit, as the multipart file field image", param="image")
        masks = [v for k, v in form.multi_items() if k == "mask" and not isinstance(v, str)]
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        try:
            body = model.model_validate(fields)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        pictures = [await image.read() for image in images]
        return body, pictures, await masks[0].read() if masks else None
    finally:
        await form.close()


def openai_router(
    pipe: engine.EngineFace, jobs: ApiJobs, links: PictureLinks | None = None, max_pixels: int | None = None
) -> APIRouter:
    """The routes; `max_pixels`: a picture sent in over this many pixels is refused from its header."""
    router = APIRouter(prefix="/v1", tags=["OpenAI Images"])
    links = links or PictureLinks()
    max_pixels = max_pixels or default_max_pixels(pipe.limits)

    generations_body, edits_body = body_models()  # the request fields as they stand when the server is built

    async def generations(body, http: Request):
        if reference_count(pipe)[0]:  # a model that only edits (FLUX.1 Kontext)
            raise ApiError(400, "this model edits a picture: send it to /v1/images/edits as image", param="prompt")
        return await draw(pipe, jobs, links, http, body)

    generations.__annotations__ = {"body": generations_body, "http": Request}  # FastAPI reads the model from here
    router.add_api_route("/images/generations", generations, methods=["POST"])

    @router.post("/images/edits")
    async def edits(http: Request):
        body, images, mask = await _read_edit_form(http, edits_body)
        pictures = await asyncio.to_thread(_edit_pictures, pipe, body, images, mask, max_pixels)
        return await draw(pipe, jobs, links, http, body, pictures)

    @router.get("/images/files/{name}", name="openai_image_file")
    async def image_file(name: str):
        picture = links.get(name)
        if picture is None:
            raise ApiError(404, "no such picture here (links last a few minutes)", code="not_found")
        kind = name.rsplit(".", 1)[-1]
        return Response(picture, media_type=f"image/{kind}", headers={"Cache-Control": "private, max-age=600"})

    @router.get("/models")
    async def models():
        """The models this server draws with (the default first), as OpenAI's model list."""
        served = getattr(pipe, "models", None)
        ids = (
            [pipe.model_name]
            if served is None
            else [served.default, *(t for t in served.titles() if t != served.default)]
        )
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "jax-sd"} for name in ids],
        }

    return router
