"""`EngineFace`: what the web layer reads from an engine, the engine's public face as a type.

`engine.Engine` (one machine) and `cluster.RemoteEngine` (replicas behind Ray Serve) both have it, and so
can a test's stand-in: the page and the APIs take any object with these members and never look further.
The members under "read with a fallback" may be missing on a stand-in; the page then assumes the plain
case (a text-to-image model, no adapters, no safety checker, one XLA device per device).
"""

from __future__ import annotations

from typing import Any, Protocol

from PIL import Image

from .families import Variant
from .request import GenerationRequest, Limits
from .serving.ticket import Ticket


class Warmup(Protocol):
    """The start-up compilation: its time, or why it failed (`engine.Engine.warmup_state`)."""

    seconds: float | None
    error: str | None


class EngineFace(Protocol):
    # What the model is and where it runs
    model_name: str  # "embedded default", a Hub id or a folder: the pictures' recipes name it
    family: str  # the family record's name (engine.families.FAMILIES)
    devices: list[str]  # one name per device ("cpu:0", "cpu:0+1"); a request's pictures are spread over them
    batch_size: int  # pictures drawn at once; the page hands the engine twice as many requests

    # What a request may ask for
    defaults: dict[str, Any]  # num_inference_steps, guidance_scale, width, height, scheduler
    limits: Limits  # every range, the sizes offered, the schedulers, the ControlNet and LoRAs

    # Read with a fallback
    label: str | None  # "Stable Diffusion XL Turbo"; else `family`
    variant: Variant | None  # the picture inputs it takes; else text to image (engine.VARIANTS[0])
    guided: bool  # False: step-distilled, the guidance scale changes nothing (FLUX.2 [klein]); else True
    controlnet: str | None  # the ControlNet's source, when one is loaded
    vae_name: str  # which VAE draws: "the model's own VAE", or the folder or Hub id given (a tiny one decodes fast)
    safety_mode: str  # "on", "off" (--no-safety-checker) or "none" (the model ships none)
    core_pairs: bool  # each device is a pair of XLA CPU devices
    dtype: str  # the networks' dtype: "float32", "bfloat16" or "float16"
    compute_path: str  # the dtype and what computes the products, for people: "float32, XLA (avx2)"
    example_prompts: list[str]  # the model's own examples; else the page's general ones
    embeddings: Any  # textual inversion: `.loaded`, `.skipped`, `.a1111()` (loading/textual_inversion.py); else none
    upscalers: Any  # the picture upscalers: `.names()`, `.entries` (loading/upscaler_folder.py); else none
    # A server of several models (`engine.ModelPool`, serving/model_pool.py's ServedModels): `.titles()`, `.default`,
    # `.match(name)` -> title (InvalidRequest listing the offered ones), `.set_default(name)`, `.refresh()`,
    # `.a1111()` (A1111's /sd-models items), `.loras()`, `.vaes()`; else one model, `model_name`
    models: Any

    # Warm-up
    @property
    def ready(self) -> bool:
        """The warm-up is done (or failed): requests no longer wait for it."""
        ...

    @property
    def warmup_state(self) -> Warmup: ...

    # Work
    def submit(self, request: GenerationRequest, caller: str = "") -> Ticket:
        """Returns at once with the request's ticket; raises `engine.InvalidRequest` or `engine.Busy`. `caller`: who
        asks (a credential, a page session, an address); waiting requests are served in callers' turns."""
        ...

    def canny_image(self, image: Image.Image) -> Image.Image:
        """The Canny edge map of a control picture, as the ControlNet will see it."""
        ...

    def upscale(self, picture: Image.Image, width: int, height: int, upscaler: str) -> Image.Image:
        """The picture at width x height through one of `upscalers` (read with a fallback: an engine without it
        offers no Extras)."""
        ...
