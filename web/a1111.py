"""AUTOMATIC1111's web UI API (`/sdapi/v1/...`) over the engine, for Open WebUI, SillyTavern, the `webuiapi`
package and the many tools that speak it. Read A1111's `modules/api/api.py` for the original.

- `txt2img` / `img2img`: one engine request of `batch_size x n_iter` pictures (seeds seed, seed+1, ...); A1111's
  sampler and scheduler names, clip skip and `<lora:name:weight>` prompt tags are read in `names.py`. An
  interrupted request answers with no pictures and `"interrupted": true` in its info, as A1111 answers 200.
- `img2img` for a model that edits from reference pictures (FLUX.2 [klein], FLUX.1 Kontext): every init image is a
  reference, in order (up to the model's `max_references`), no mask is taken, and `denoising_strength` is ignored
  (nothing is redrawn from a noised picture: the model edits as the prompt says); width and height as sent, or the
  first picture's size. A model that only edits (Kontext) refuses txt2img.
- `png-info`: a picture's recipe, read as A1111 reads it.
- `progress` / `interrupt` / `skip`: about the caller's own running API requests (`skip` stops them as `interrupt`
  does: A1111 skips the picture of a batch it is drawing, and here a batch's pictures are drawn together) (`api_common.ApiJobs`), not the server's;
  no preview when callers cannot be told apart (anonymous behind a proxy that is not trusted: callers.py).
- `sd-models` / `options`: the server's models. Started with `--models DIR` (engine.ModelPool): every usable
  checkpoint of the folder in A1111's shape; `POST /options {"sd_model_checkpoint": ...}` sets the default model as
  A1111 switches (it loads in the background; requests wait for it), a request may name its own in
  `override_settings`, `refresh-checkpoints` reads the folder again, `sd-vae` and `loras` list its `VAE/` and
  `Lora/`. Started with one model: setting `sd_model_checkpoint` to it is accepted, to any other refused (422).
  Other options are accepted and change nothing (the server's settings are not one client's to change;
  per-request `override_settings` are read).
- `embeddings`: the textual inversion files the server loaded (and those it skipped, with why); `upscalers`,
  `latent-upscale-modes` and the Extras (`extra-single-image`, `extra-batch-images`): a1111_extras.py.
- Lists of what jax-sd does not have (VAEs, scripts, hypernetworks, ...) are empty, in A1111's shapes.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from fastapi import APIRouter, Body, Request
from PIL import Image, ImageOps

import engine
from engine import request_fields
from engine.compat.pnginfo import (
    CHUNK_KEY,
    GenerationParameters,
    format_parameters,
    infotext_items,
    png_info,
    title_parts,
)

from . import names
from .a1111_extras import add_extras_routes
from .a1111_models import (
    EmbeddingsResponse,
    ImagesResponse,
    Img2ImgRequest,
    LoraItem,
    PNGInfoRequest,
    PNGInfoResponse,
    ProgressResponse,
    ProgressState,
    SamplerItem,
    SchedulerItem,
    ScriptsList,
    SDModelItem,
    Txt2ImgRequest,
    body_models,
)
from .api_common import (
    ApiJob,
    ApiJobs,
    b64,
    caller_of,
    decode_base64,
    opaque,
    preview_png,
    read_picture,
    read_references,
    reference_count,
    result_pngs,
)
from .api_gate import internal_error
from .pictures import default_max_pixels
from .requests import api_request, read_value


def _refuse(message: str) -> engine.InvalidRequest:
    return engine.InvalidRequest(message)


# ---- the model --------------------------------------------------------------------------------------


def model_title(pipe: engine.EngineFace) -> str:
    return pipe.model_name


def check_model(pipe: engine.EngineFace, name: Any) -> str | None:
    """The model a client names (`sd_model_checkpoint`), as the request's `model`. On a server of several
    (`--models`) it is matched as A1111 matches a checkpoint (a title, name or hash; an unknown name is refused with
    the names offered); None or "": the server's default. On a server of one model a client may name it (A1111 titles
    carry a " [hash]" and a file extension) and any other is refused, never switched to; its requests carry None."""
    if name is None or name == "":
        return None
    served = getattr(pipe, "models", None)  # a server of several: engine.ModelPool's ServedModels
    if served is not None:
        return served.match(str(name))
    wanted = re.sub(r"\s*\[[0-9a-fA-F]*\]$", "", str(name).strip())
    wanted = re.sub(r"\.(safetensors|ckpt)$", "", wanted)
    title = model_title(pipe)
    if wanted not in (title, title.rsplit("/", 1)[-1]):
        raise _refuse(
            f"model {name!r} is not served here: this server serves only {title!r} and does not switch models "
            "(its --model is chosen when it starts)"
        )
    return None


# ---- requests ----------------------------------------------------------------------------------------


def _binary_mask(mask: Image.Image, invert: bool) -> Image.Image:
    """A1111's mask: white repaints; a mask with transparent pixels is read from its alpha; rounded to 0 or 255."""
    if mask.mode in ("RGBA", "LA") and mask.getchannel("A").getextrema() != (255, 255):
        mask = mask.getchannel("A")
    mask = mask.convert("L").point(lambda v: 255 if v > 128 else 0)
    return ImageOps.invert(mask) if invert else mask


def _pictures(pipe: engine.EngineFace, body: Img2ImgRequest, max_pixels: int) -> dict[str, Any]:
    """The request's pictures from img2img's base64 fields, sizes checked before pixels are read. For a model that
    edits from reference pictures (FLUX.2 [klein], FLUX.1 Kontext) every init image is one, in order, and no mask is
    taken; for any other, the one picture (and mask), which the engine resizes by resize_mode, and whose mask's blur,
    "only masked" and fill it applies (the request's fields)."""
    if reference_count(pipe)[1]:
        if body.mask:
            raise _refuse("this model edits from the init images alone and takes no mask; send none")
        encoded = body.init_images or []
        pictures = [decode_base64(data, f"init_images[{k}]") for k, data in enumerate(encoded)]
        return {"references": read_references(pipe, pictures, "init_images", max_pixels)}
    if not body.init_images:
        raise _refuse("img2img needs init_images: a list with one base64 picture")
    if len(body.init_images) > 1:
        raise _refuse("img2img draws from one init image per request here; send each picture in its own request")
    image = read_picture(decode_base64(body.init_images[0], "init_images[0]"), "init_images[0]", max_pixels)
    fields: dict[str, Any] = {"image": opaque(image)}
    if body.mask:
        mask = read_picture(decode_base64(body.mask, "mask"), "mask", max_pixels)
        fields["mask_image"] = _binary_mask(mask, bool(body.inpainting_mask_invert))
    return fields


# The request fields A1111's door reads its own way: the prompt (its `<lora:...>` tags), the sampler's and schedule's
# names, the number of pictures (batch_size x n_iter), the pictures, the model (matched by check_model).
OWN_FIELDS = ("prompt", "scheduler", "num_images", "lora_scales", "image", "mask_image", "model")


def body_values(body: Txt2ImgRequest) -> dict[str, Any]:
    """The request fields under their A1111 names in the body, or its `override_settings` (which win), as ours."""
    settings = body.override_settings or {}
    values = {}
    for f in request_fields.current():
        if f.name in OWN_FIELDS:
            continue
        value = settings.get(f.a1111_setting) if f.a1111_setting in settings else getattr(body, f.a1111 or "", None)
        if value is None and f.a1111_default is not None and f.a1111 in type(body).model_fields:
            value = f.a1111_default  # A1111's own default (mask_blur 4, only masked, fill), not ours
        if value is None or value == "":
            continue
        if f.from_a1111 is not None:
            value = f.from_a1111(read_value(f, value, f.a1111_setting or f.a1111))
        values[f.name] = value
    return _hires_values(body, values)


def _hires_values(body: Txt2ImgRequest, values: dict[str, Any]) -> dict[str, Any]:
    """A1111's hires fix: its fields count only with enable_hr (then hr_scale is 2 unless a size is given; a size
    of 0 is none), and txt2img's denoising_strength is the second pass's."""
    hires_fields = [f.name for f in request_fields.current() if f.name.startswith("hires_")]
    if isinstance(body, Img2ImgRequest):
        return {k: v for k, v in values.items() if k not in hires_fields}
    if not body.enable_hr:
        return {k: v for k, v in values.items() if k not in hires_fields and k != "strength"}
    for side in ("hires_width", "hires_height"):
        if values.get(side) == 0:
            del values[side]
    if "hires_scale" not in values:
        values["hires_scale"] = 2.0  # A1111's default
    if body.denoising_strength is not None:
        values["strength"] = body.denoising_strength
    return values


def build_request(
    pipe: engine.EngineFace, body: Txt2ImgRequest, pictures: dict[str, Any] | None = None
) -> engine.GenerationRequest:
    settings = body.override_settings or {}
    model = check_model(pipe, settings.get("sd_model_checkpoint"))
    if body.batch_size < 1 or body.n_iter < 1:
        raise _refuse(f"batch_size and n_iter must be at least 1, got {body.batch_size} and {body.n_iter}")
    prompt, loras = names.take_loras(body.prompt)
    values = body_values(body)
    if "references" in (pictures or {}):  # editing from references redraws no picture: denoising_strength is ignored
        values.pop("strength", None)
    hires = {}
    if getattr(body, "enable_hr", False) and body.hr_sampler_name and not isinstance(body, Img2ImgRequest):
        hires["hires_scheduler"] = names.a1111_scheduler(pipe, body.hr_sampler_name, body.hr_scheduler)
    return api_request(
        prompt,
        scheduler=names.a1111_scheduler(pipe, body.sampler_name or body.sampler_index, body.scheduler),
        **hires,
        num_images=body.batch_size * body.n_iter,
        lora_scales=loras,
        **values,
        model=model,
        **(pictures or {}),
    )


def read_png_info(image: str, max_pixels: int) -> PNGInfoResponse:
    """A1111's `/png-info`: the picture's "parameters" text, its other text chunks, and the parameters read."""
    picture = read_picture(decode_base64(image, "image"), "image", max_pixels)
    text = picture.info.get(CHUNK_KEY)
    items = {key: value for key, value in picture.info.items() if key != CHUNK_KEY and isinstance(value, str)}
    params = png_info(picture)
    return PNGInfoResponse(
        info=text if isinstance(text, str) else "", items=items, parameters=infotext_items(params) if params else {}
    )


# ---- answers ------------------------------------------------------------------------------------------


def info(pipe, body: Txt2ImgRequest, r: engine.GenerationRequest, seeds, withheld, interrupted=False) -> dict:
    """A1111's `Processed.js()`: what was drawn, with one infotext (the PNG's parameters) per picture."""
    sampler, schedule = names.a1111_names(r.scheduler)
    n = len(seeds)
    texts = [format_parameters(GenerationParameters.from_request(r, seed, pipe.model_name)) for seed in seeds]
    model_name, model_hash = title_parts(r.model) if r.model else (pipe.model_name, None)
    extra = {"Schedule type": schedule}
    if r.lora_scales:
        extra["Lora weights"] = ", ".join(f"{name}: {weight:g}" for name, weight in r.lora_scales.items())
    return {
        "prompt": r.prompt,
        "all_prompts": [r.prompt] * n,
        "negative_prompt": r.negative_prompt or "",
        "all_negative_prompts": [r.negative_prompt or ""] * n,
        "seed": r.seed,
        "all_seeds": list(seeds),
        "subseed": -1,
        "all_subseeds": [-1] * n,
        "subseed_strength": 0,
        "width": r.width,
        "height": r.height,
        "sampler_name": sampler,
        "scheduler": schedule,
        "cfg_scale": r.guidance_scale,
        "steps": r.num_inference_steps,
        "batch_size": body.batch_size,
        "n_iter": body.n_iter,
        "restore_faces": False,
        "face_restoration_model": None,
        "sd_model_name": model_name,
        "sd_model_hash": model_hash,
        "sd_vae_name": None,
        "sd_vae_hash": None,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": r.strength if r.image is not None or r.hires else None,
        "enable_hr": r.hires,
        "clip_skip": r.clip_skip + 1,
        "extra_generation_params": extra,
        "index_of_first_image": 0,
        "infotexts": texts,
        "styles": [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
        "is_using_inpainting_conditioning": r.mask_image is not None,
        "version": "jax-sd",
        "nsfw_content_detected": list(withheld),
        "interrupted": interrupted,
    }


def _parameters(body: Txt2ImgRequest) -> dict[str, Any]:
    values = body.model_dump()
    if isinstance(body, Img2ImgRequest) and not body.include_init_images:
        values["init_images"] = values["mask"] = None
    return values


async def generate(pipe, jobs: ApiJobs, body: Txt2ImgRequest, request, http: Request) -> ImagesResponse:
    job: ApiJob = await jobs.run(pipe, request, http)
    if isinstance(job.error, engine.Cancelled):
        text = json.dumps(info(pipe, body, job.request, job.request.image_seeds(), [], interrupted=True))
        return ImagesResponse(images=[], parameters=_parameters(body), info=text)
    if isinstance(job.error, engine.InvalidRequest):
        raise job.error
    if job.error is not None:
        raise internal_error(job.error, "A1111 API")
    pngs = await asyncio.to_thread(result_pngs, job.result, pipe.model_name)
    r = job.result.request or job.request
    details = info(pipe, body, r, [seed for _, seed, _ in pngs], [withheld for _, _, withheld in pngs])
    images = [b64(png) for png, _, _ in pngs] if body.send_images else []
    return ImagesResponse(images=images, parameters=_parameters(body), info=json.dumps(details))


# ---- the router -----------------------------------------------------------------------------------------


def a1111_router(pipe: engine.EngineFace, jobs: ApiJobs, max_pixels: int | None = None) -> APIRouter:
    """The routes; `max_pixels`: a picture sent in over this many pixels is refused from its header."""
    router = APIRouter(prefix="/sdapi/v1", tags=["AUTOMATIC1111"])
    max_pixels = max_pixels or default_max_pixels(pipe.limits)
    txt2img_body, img2img_body = body_models()  # the request fields as they stand when the server is built

    async def txt2img(body, http: Request):
        if reference_count(pipe)[0]:  # a model that only edits (FLUX.1 Kontext)
            raise _refuse("this model edits a picture: send it to img2img in init_images")
        return await generate(pipe, jobs, body, build_request(pipe, body), http)

    async def img2img(body, http: Request):
        pictures = await asyncio.to_thread(_pictures, pipe, body, max_pixels)
        return await generate(pipe, jobs, body, build_request(pipe, body, pictures), http)

    for path, route, model in (("/txt2img", txt2img, txt2img_body), ("/img2img", img2img, img2img_body)):
        route.__annotations__ = {"body": model, "http": Request}  # FastAPI reads the body's model from here
        router.add_api_route(path, route, methods=["POST"], response_model=ImagesResponse)

    @router.get("/progress", response_model=ProgressResponse)
    async def progress(http: Request, skip_current_image: bool = False):
        caller = caller_of(http)
        mine = jobs.of(caller)
        if not mine:
            return ProgressResponse()
        job = mine[0]
        total = job.total or job.request.num_inference_steps or 0
        done = max(job.step / total if total else 0.0, 0.01)
        elapsed = time.time() - job.started
        state = ProgressState(
            job=f"{len(mine)} API request{'s' if len(mine) != 1 else ''}",
            job_count=len(mine),
            job_timestamp=time.strftime("%Y%m%d%H%M%S", time.localtime(job.started)),
            sampling_step=job.step,
            sampling_steps=total,
        )
        waiting = f"Waiting for a free slot: number {job.position} in line."
        shown = not skip_current_image and not caller.shared  # a shared caller's preview may be another's picture
        image = await asyncio.to_thread(preview_png, job) if shown else None
        return ProgressResponse(
            progress=min(done, 1.0),
            eta_relative=max(elapsed / done - elapsed, 0.0),
            state=state,
            current_image=b64(image) if image else None,
            textinfo=f"Loading the model {job.loading}." if job.loading else waiting if job.position else None,
        )

    @router.post("/interrupt")
    async def interrupt(http: Request):
        jobs.interrupt(caller_of(http))
        return {}

    @router.post("/skip")
    async def skip(http: Request):
        jobs.interrupt(caller_of(http))
        return {}

    @router.post("/png-info", response_model=PNGInfoResponse)
    async def png_information(body: PNGInfoRequest):
        return await asyncio.to_thread(read_png_info, body.image, max_pixels)

    served = getattr(pipe, "models", None)  # a server of several models (--models DIR), or None

    @router.get("/sd-models", response_model=list[SDModelItem])
    async def sd_models():
        if served is not None:
            return [SDModelItem(**item) for item in served.a1111()]
        title = model_title(pipe)
        return [SDModelItem(title=title, model_name=title.rsplit("/", 1)[-1], filename=title)]

    @router.get("/options")
    async def get_options():
        default = served.default if served is not None else model_title(pipe)
        items = served.a1111() if served is not None else []
        return {
            "sd_model_checkpoint": default,
            "sd_checkpoint_hash": next((item["sha256"] for item in items if item["title"] == default), None),
            "sd_vae": "Automatic",
            "CLIP_stop_at_last_layers": 1,
            "samples_format": "png",
            # Ours, beside A1111's: the networks' dtype and what computes them on this server ("float32, XLA (avx2)").
            "jax_sd_dtype": getattr(pipe, "dtype", None),
            "jax_sd_compute_path": getattr(pipe, "compute_path", None),
        }

    @router.post("/options")
    async def set_options(options: dict[str, Any] = Body(...)):  # noqa: B008 - FastAPI's way to take any JSON object
        name = options.get("sd_model_checkpoint")
        if served is not None and name not in (None, ""):
            served.set_default(str(name))  # the default from now on, as A1111 switches; it loads in the background
        else:
            check_model(pipe, name)
        return None

    @router.get("/samplers", response_model=list[SamplerItem])
    async def samplers():
        return [SamplerItem(name=name, aliases=names.sampler_aliases(name, pipe)) for name in names.samplers(pipe)]

    @router.get("/schedulers", response_model=list[SchedulerItem])
    async def schedulers():
        return [
            SchedulerItem(name=name, label=label, aliases=list(aliases) or None)
            for name, (label, aliases) in names.SCHEDULES.items()
        ]

    @router.get("/loras", response_model=list[LoraItem])
    async def loras():
        given = getattr(pipe.limits, "loras", ())  # --lora NAME=PATH, then a models folder's Lora/
        folder = [LoraItem(**item) for item in served.loras()] if served is not None else []
        return [LoraItem(name=name, alias=name) for name in given] + [i for i in folder if i.name not in given]

    @router.get("/scripts", response_model=ScriptsList)
    async def scripts():
        return ScriptsList()

    @router.get("/embeddings", response_model=EmbeddingsResponse)
    async def embeddings():
        loaded = getattr(pipe, "embeddings", None)  # textual inversion: the files --embeddings DIR loaded
        return EmbeddingsResponse(**loaded.a1111()) if loaded is not None else EmbeddingsResponse()

    add_extras_routes(router, pipe, max_pixels)
    if served is not None:  # before the empty lists and no-op refreshes below, which they replace

        @router.get("/sd-vae", response_model=list[dict[str, Any]])
        async def sd_vae():
            return served.vaes()

        async def refresh() -> None:
            await asyncio.to_thread(served.refresh)  # new files are hashed

        for path in ("refresh-checkpoints", "refresh-loras", "refresh-vae"):
            router.add_api_route(f"/{path}", refresh, methods=["POST"])
    for path in ("sd-vae", "hypernetworks", "face-restorers", "prompt-styles"):
        router.add_api_route(f"/{path}", _nothing, methods=["GET"], response_model=list[dict[str, Any]])
    for path in ("refresh-checkpoints", "refresh-loras", "refresh-vae"):
        router.add_api_route(f"/{path}", _done, methods=["POST"])
    return router


async def _nothing() -> list:
    return []


async def _done() -> None:
    return None
