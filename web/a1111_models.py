"""AUTOMATIC1111's web UI API on the wire: the bodies its clients send and the answers they read, as pydantic
models named after A1111's `modules/api/models.py`; the request fields' part of the bodies comes from
`engine.request_fields` (their `a1111` names). Only the fields jax-sd reads or writes are declared; any
other field a client sends (restore_faces, scripts, ...) is accepted and ignored, as A1111's own
clients send dozens of them. A value left out takes the model's own default (A1111's would be 512x512, 50
steps, CFG 7), except `seed`, which is random (-1) as in A1111.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from engine import request_fields


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Txt2ImgOwn(_Body):
    # What A1111's txt2img body holds of its own; the request fields with an A1111 name are added from
    # `request_fields` (`body_models`), each as its type or null, null meaning the model's own default.
    prompt: str = ""
    negative_prompt: str | None = ""
    seed: int | None = -1  # -1: random; picture k of the request gets seed + k
    sampler_name: str | None = None  # "Euler a", "DPM++ 2M", ...; none: the model's own default
    sampler_index: str | None = None  # A1111's older name for sampler_name
    scheduler: str | None = None  # "Automatic", "Uniform", "Karras" (or their lower-case names)
    batch_size: int = 1
    n_iter: int = 1  # batch_size x n_iter pictures in all
    override_settings: dict[str, Any] | None = None
    send_images: bool = True
    # Hires fix: off unless enable_hr; then hr_scale (default 2) or hr_resize_x / hr_resize_y (0: none; both: cover,
    # then cut), hr_upscaler, hr_second_pass_steps, hr_prompt, hr_negative_prompt, and denoising_strength (default
    # 0.7) for the second pass; hr_sampler_name (with hr_scheduler) its sampler, read as sampler_name is.
    enable_hr: bool = False
    denoising_strength: float | None = None
    hr_sampler_name: str | None = None
    hr_scheduler: str | None = None


class _Img2ImgOwn(_Body):
    init_images: list[str] | None = None  # base64 pictures, with or without a data: prefix; one is drawn from
    mask: str | None = None  # base64; white: repaint (its alpha, when it has transparent pixels)
    inpainting_mask_invert: int = 0  # 1: black repaints
    include_init_images: bool = False


def _derived(own: type[BaseModel], pictures: bool) -> dict[str, Any]:
    """The request fields with an A1111 body name that `own` does not declare: those that need a picture only
    when `pictures`."""
    fields = request_fields.current()
    return {
        f.a1111: (f.type | None, None)
        for f in fields
        if f.a1111 and f.a1111 not in own.model_fields and f.needs_image == pictures
    }


@functools.cache
def _body_models(fields: tuple) -> tuple[type[BaseModel], type[BaseModel]]:
    txt2img = create_model("Txt2ImgRequest", __base__=_Txt2ImgOwn, **_derived(_Txt2ImgOwn, False))
    img2img = create_model("Img2ImgRequest", __base__=(txt2img, _Img2ImgOwn), **_derived(_Img2ImgOwn, True))
    return txt2img, img2img


def body_models() -> tuple[type[BaseModel], type[BaseModel]]:
    """(Txt2ImgRequest, Img2ImgRequest) for the request fields as they stand (`request_fields.current()`)."""
    return _body_models(request_fields.current())


Txt2ImgRequest, Img2ImgRequest = body_models()


class PNGInfoRequest(_Body):
    image: str  # a base64 PNG (or JPEG / WebP), with or without a data: prefix


class PNGInfoResponse(BaseModel):
    info: str = Field(description="the picture's 'parameters' text, as written")
    items: dict[str, Any] = Field(description="the picture's other text chunks")
    parameters: dict[str, Any] = Field(description="the parameters read: Prompt, Negative prompt, Steps, ...")


class ImagesResponse(BaseModel):
    images: list[str] = Field(description="base64 PNG files, each with its 'parameters' text chunk")
    parameters: dict[str, Any]
    info: str = Field(description="a JSON object as text: seeds, sizes, sampler, infotexts")


class ProgressState(BaseModel):
    skipped: bool = False
    interrupted: bool = False
    stopping_generation: bool = False
    job: str = ""
    job_count: int = 0
    job_timestamp: str = "0"
    job_no: int = 0
    sampling_step: int = 0
    sampling_steps: int = 0


class ProgressResponse(BaseModel):
    progress: float = 0.0
    eta_relative: float = 0.0
    state: ProgressState = ProgressState()
    current_image: str | None = None
    textinfo: str | None = None


class SamplerItem(BaseModel):
    name: str
    aliases: list[str]
    options: dict[str, str] = {}


class SchedulerItem(BaseModel):
    name: str
    label: str
    aliases: list[str] | None = None
    default_rho: float = -1
    need_inner_model: bool = False


class SDModelItem(BaseModel):
    title: str
    model_name: str
    hash: str | None = None
    sha256: str | None = None
    filename: str
    config: str | None = None


class LoraItem(BaseModel):
    name: str
    alias: str
    path: str | None = None
    metadata: dict[str, Any] = {}


class ScriptsList(BaseModel):
    txt2img: list[str] = []
    img2img: list[str] = []


class EmbeddingsResponse(BaseModel):
    loaded: dict[str, Any] = {}
    skipped: dict[str, Any] = {}
