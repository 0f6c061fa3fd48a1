"""What travels from the page to the UNet: a frozen `GenerationRequest`, the `Limits` it is checked against,
and the `GenerationResult` that comes back.

One validator (`Limits.check`) for the engine, the page and the API: the page reads its slider ranges and
its sizes from the same `Limits`, so the two can never disagree. Values keep their names from the page to
`pipeline.denoise` (`guidance_scale`, `num_inference_steps`, ...), as diffusers' `__call__` names them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from .errors import InvalidRequest
from .request_references import check_references, reference_fill

SEED_LIMIT = 2**32  # seeds are uint32, as PRNGKey takes them
# A1111's img2img resize modes and inpainting starts ("Masked content"), by their numbers (sampling/inpaint.py)
RESIZE_MODES = {0: "just resize", 1: "crop and resize", 2: "resize and fill", 3: "just resize (latent upscale)"}
FILLS = {0: "fill", 1: "original", 2: "latent noise", 3: "latent nothing"}
# Flux2ImageProcessor.check_image_input: a reference picture has no side shorter, and no aspect wider
DEFAULTED = ("num_inference_steps", "guidance_scale", "height", "width", "scheduler")  # a model's defaults fill these
HIRES_STRENGTH = 0.7  # A1111's denoising strength for hires fix's second pass when a request gives none


@dataclass(frozen=True)
class GenerationRequest:
    """One user's request. None means "the model's default" until `Limits.resolve` fills it in."""

    prompt: str
    negative_prompt: str | None = None  # None: no negative prompt at all (SDXL zeroes it); "": the empty text
    seed: int = 0  # image k uses seed + k (mod 2**32)
    num_inference_steps: int | None = None
    guidance_scale: float | None = None  # classifier-free guidance; off at <= 1
    height: int | None = None
    width: int | None = None
    num_images: int | None = None  # default: images_per_device on every device
    scheduler: str | None = None
    clip_skip: int = 0  # read the text encoder this many layers before its last
    latents: np.ndarray | None = field(default=None, compare=False, repr=False)  # [n, c, h/8, w/8] NCHW noise
    # ControlNet (a server started with one): the picture that steers every image, resized to the request's size.
    control_image: Image.Image | None = field(default=None, compare=False, repr=False)
    controlnet_conditioning_scale: float = 1.0  # the ControlNet's residuals are multiplied by this
    # The server's LoRAs by name -> weight; a loaded LoRA left out keeps weight 1.0, as after diffusers'
    # `load_lora_weights`; 0 turns one off. `Limits.resolve` fills in every name.
    lora_scales: Mapping[str, float] | None = field(default=None, hash=False)
    image: Image.Image | None = field(default=None, compare=False, repr=False)  # start from this picture
    # Reference pictures the model edits from or draws beside, for a model that edits (FLUX.2 [klein]): each is
    # drawn at `Limits.reference_size` and read as tokens beside the latents'; with none and no size given, the
    # output takes the first one's size. At most `Limits.max_references` (0: the model does not edit).
    references: tuple[Image.Image, ...] = field(default=(), compare=False, repr=False)
    mask_image: Image.Image | None = field(default=None, compare=False, repr=False)  # white: repaint (inpainting)
    strength: float | None = None  # with an image: how much of the schedule runs (1: all of it)
    # The sampler's stochasticity, as diffusers' pipelines pass `eta` to `scheduler.step`: DDIM's eta (0: the
    # deterministic DDIM, 1: DDPM-like), TCD's gamma; the other schedulers take none and ignore it.
    eta: float = 0.0
    # DeepCache: the UNet runs whole every `deep_cache` steps and between them only its first level, reusing the
    # deep features of the last whole step (0 or 1: every step whole). Faster, not the same picture.
    deep_cache: int = 0
    # Token merging (ToMe): this share of the first UNet level's tokens is merged into similar ones before each of
    # its self-attentions and copied back after (A1111's "Token merging ratio"; 0: off). Faster, not the same picture.
    token_merging: float = 0.0
    # Hires fix, as A1111 does it: the pictures drawn, then upscaled (their latents, or the pictures by a named
    # upscaler) to `hires_scale` times the size (or hires_width x hires_height) and drawn again there as image to
    # image at `strength` (default 0.7) for `hires_steps` (0: num_inference_steps). 0: off.
    hires_scale: float = 0.0
    hires_width: int | None = None
    hires_height: int | None = None
    hires_upscaler: str = "Latent"
    hires_steps: int = 0
    # The second pass's own sampler, prompts and strength (None: the first pass's; the strength: `strength`, 0.7).
    hires_scheduler: str | None = None
    hires_prompt: str | None = None
    hires_negative_prompt: str | None = None
    hires_strength: float | None = None
    # A1111's image to image (sampling/inpaint.py): a picture of another size resized by `resize_mode` (0 just
    # resize, 1 crop and resize, 2 resize and fill, 3 as 0); the mask blurred by `mask_blur` and the picture laid back
    # over the drawing through it (None: neither); `inpaint_full_res`: only the mask's box (grown by the padding)
    # drawn at the request's size and pasted back; `inpainting_fill`: the masked part starts from the colours around
    # it (0), the picture (1), latent noise (2) or latent zeros (3).
    resize_mode: int = 0
    mask_blur: int | None = None
    inpaint_full_res: bool = False
    inpaint_full_res_padding: int = 32
    inpainting_fill: int = 1
    # Start from these scaled latents, [n, h/8, w/8, c] (image to image without encoding a picture: hires fix's
    # second pass after a latent upscaler); and hand the final latents back in the result (its first pass).
    image_latents: np.ndarray | None = field(default=None, compare=False, repr=False)
    return_latents: bool = False
    # Which model draws, on a server of several (`--models DIR`): a title, name, file name or hash as A1111's
    # /sdapi/v1/sd-models lists them; the pool sets it to the model's title. None: the server's default model.
    model: str | None = None

    @property
    def guided(self) -> bool:
        """Guidance at scale <= 1 changes nothing, so the unconditional half is not computed at all."""
        return float(self.guidance_scale) > 1.0

    @property
    def hires(self) -> bool:
        """A second pass at a larger size follows the first (hires fix)."""
        return bool(self.hires_scale) or self.hires_width is not None or self.hires_height is not None

    def hires_size(self) -> tuple[int, int]:
        """The second pass's (width, height), as A1111's `calculate_target_resolution` without its crop: the given
        sides (one of them: the other keeps the aspect), else the first pass's times `hires_scale`; rounded to 8."""
        w, h = int(self.width), int(self.height)
        if self.hires_width and self.hires_height:
            return int(self.hires_width), int(self.hires_height)
        if self.hires_width:
            return int(self.hires_width), _round8(self.hires_width * h / w)
        if self.hires_height:
            return _round8(self.hires_height * w / h), int(self.hires_height)
        return _round8(w * self.hires_scale), _round8(h * self.hires_scale)

    def hires_cover(self) -> tuple[int, int]:
        """The size the first pass is upscaled to: `hires_size()`, but with both sides given the size at the first
        pass's aspect that covers them (A1111's `calculate_target_resolution`), which is then cut to them in the
        middle (serving/hires.py)."""
        if not (self.hires_width and self.hires_height):
            return self.hires_size()
        w, h, tw, th = int(self.width), int(self.height), int(self.hires_width), int(self.hires_height)
        if w / h < tw / th:
            return tw, tw * h // w
        return th * w // h, th

    @property
    def controlled(self) -> bool:
        """A control picture came with the request: the ControlNet steers it (a static part of the plan)."""
        return self.control_image is not None

    def image_seeds(self) -> list[int]:
        return [(int(self.seed) + k) % SEED_LIMIT for k in range(int(self.num_images))]


def _round8(value: float) -> int:
    return int(value) // 8 * 8


def _whole(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def size_label(width: int, height: int) -> str:
    return f"{width}x{height}"


def common_sizes(side: int, multiple: int, min_side: int) -> tuple[tuple[int, int], ...]:
    """The model's own square and the usual aspect ratios at about the same pixel count, (width, height).

    Like SDXL's training buckets: 4:3, 3:2 and 16:9, each both ways, sides in 64-pixel steps; a
    small model's short side stays at least `min_side`.
    """
    sizes = [(side, side)]
    for long, short in ((4, 3), (3, 2), (16, 9)):
        scale = max(side / math.sqrt(long * short), min_side / short)
        step = max(multiple, min(64, side // 8))  # SD's usual 64-pixel steps; a tiny model's own factor
        w, h = (round(n * scale / step) * step for n in (long, short))
        sizes += [(w, h), (h, w)]
    return tuple(dict.fromkeys(sizes))


@dataclass(frozen=True)
class Limits:
    """The ranges the engine accepts, published for the page."""

    schedulers: tuple[str, ...]
    side_multiple: int  # sides are multiples of this: the VAE's downscale factor times the denoiser's patch side
    max_side: int
    max_clip_skip: int
    devices: int
    sizes: tuple[tuple[int, int], ...] | None = None  # (width, height) offered; None: any size in range
    max_steps: int = 150
    guidance_range: tuple[float, float] = (0.0, 30.0)
    max_images: int = 64
    max_images_per_device: int = 8
    max_prompt_chars: int = 2000  # stops absurd payloads before tokenizing; `max_chunks` is the real bound
    max_chunks: int = 4  # 75-token chunks of a prompt (300 tokens): each count is a context length to compile
    control: bool = False  # the server loaded a ControlNet: requests may bring a control image
    control_scale_range: tuple[float, float] = (0.0, 2.0)
    loras: tuple[str, ...] = ()  # the names of the LoRAs the server loaded
    lora_scale_range: tuple[float, float] = (-2.0, 2.0)  # negative weights push away from a LoRA's style
    eta_range: tuple[float, float] = (0.0, 1.0)
    max_deep_cache: int = 0  # the longest DeepCache interval; 0: the model's denoiser has no deep features to reuse
    max_token_merging: float = 0.0  # the largest token merging ratio; 0: the model's denoiser has no UNet levels
    hires_scale_range: tuple[float, float] = (1.0, 4.0)  # hires fix's upscale factor, when on
    upscalers: tuple[str, ...] = ()  # hires fix's upscalers: the latent ones, then the pictures' (Lanczos, ...)
    max_mask_blur: int = 64  # the mask's blur, a Gaussian's sigma in pixels (A1111's slider ends there too)
    max_inpaint_padding: int = 256  # "only masked": pixels around the mask's box
    max_references: int = 0  # reference pictures a request may bring (`references`); 0: the model does not edit
    reference_pixels: int = 1024 * 1024  # a larger reference is shrunk to about this many, as the family's pipeline
    min_references: int = 0  # reference pictures a request must bring: a model that only edits (FLUX.1 Kontext: 1)
    # (width, height) a reference is drawn at, the nearest its aspect (FLUX.1 Kontext's); empty: `reference_pixels`
    reference_resolutions: tuple[tuple[int, int], ...] = ()
    # The VAE reads pictures: False for a tiny VAE's decoder alone (`--vae taesd_decoder.safetensors`), which refuses
    # the requests that bring one to read (image to image, inpainting, references; hires fix offers latent upscalers)
    encodes: bool = True

    @property
    def min_side(self) -> int:
        return 8 * self.side_multiple  # a latent of at least 8x8

    def resolve(self, request: GenerationRequest, defaults: dict, images_per_device: int = 1) -> GenerationRequest:
        """Fills the None fields with the model's defaults, then checks the request; returns it complete."""
        fill = {name: defaults[name] for name in DEFAULTED if getattr(request, name) is None}
        if request.num_images is None:
            fill["num_images"] = self.devices * images_per_device
        if self.loras and (request.lora_scales is None or isinstance(request.lora_scales, Mapping)):
            fill["lora_scales"] = {**dict.fromkeys(self.loras, 1.0), **(request.lora_scales or {})}
        if isinstance(request.image, Image.Image) and request.height is None and request.width is None:
            fill["width"], fill["height"] = self.image_size(request.image)
        fill |= reference_fill(self, request)
        if request.strength is None and (request.image is not None or request.image_latents is not None):
            fill["strength"] = defaults.get("strength", 0.8)
        elif request.hires and request.hires_strength is not None:  # the second pass's own wins
            fill["strength"] = request.hires_strength
        elif request.strength is None and request.hires:
            fill["strength"] = HIRES_STRENGTH
        request = dataclasses.replace(request, **fill) if fill else request
        self.check(request)
        return request

    def image_size(self, image: Image.Image) -> tuple[int, int]:
        """(width, height) for a picture when the request gives none: its own, fitted to the limits, rounded
        down to the VAE's multiple as diffusers' `VaeImageProcessor` does; the nearest offered size if sizes
        are fixed."""
        m = self.side_multiple
        scale = min(1.0, self.max_side / max(image.size))
        w, h = (max(self.min_side, int(side * scale) // m * m) for side in image.size)
        if self.sizes is None or (w, h) in self.sizes:
            return w, h
        aspect = math.log(w / h)
        return min(self.sizes, key=lambda s: (abs(math.log(s[0] / s[1]) - aspect), abs(s[0] * s[1] - w * h)))

    def check(self, r: GenerationRequest) -> None:
        """Raises InvalidRequest with a message that says what to change; the first problem found wins."""
        for name, text in (("prompt", r.prompt), ("negative prompt", r.negative_prompt)):
            if text is None and name == "negative prompt":
                continue
            if not isinstance(text, str):
                raise InvalidRequest(f"{name} must be text")
            if len(text) > self.max_prompt_chars:
                raise InvalidRequest(f"{name} is too long ({len(text)} characters; at most {self.max_prompt_chars})")
        if not _whole(r.seed) or not 0 <= r.seed < SEED_LIMIT:
            raise InvalidRequest(f"seed must be a whole number from 0 to {SEED_LIMIT - 1}, got {r.seed!r}")
        steps = r.num_inference_steps
        if not _whole(steps) or not 1 <= steps <= self.max_steps:
            raise InvalidRequest(f"steps must be a whole number from 1 to {self.max_steps}, got {steps!r}")
        low, high = self.guidance_range
        g = r.guidance_scale
        if not _number(g) or not math.isfinite(g) or not low <= g <= high:
            raise InvalidRequest(f"guidance scale must be a number from {low:g} to {high:g}, got {g!r}")
        self._check_size(r)
        if not _whole(r.num_images) or not 1 <= r.num_images <= self.max_images:
            raise InvalidRequest(f"number of images must be from 1 to {self.max_images}, got {r.num_images!r}")
        if r.scheduler not in self.schedulers:
            raise InvalidRequest(f"unknown scheduler {r.scheduler!r}; choose one of {', '.join(self.schedulers)}")
        if not _whole(r.clip_skip) or not 0 <= r.clip_skip <= self.max_clip_skip:
            if self.max_clip_skip == 0:  # FLUX.1 reads CLIP's pooled output only: there is no layer to skip to
                raise InvalidRequest(
                    f"clip_skip must be 0: this model skips no text encoder layers, got {r.clip_skip!r}"
                )
            raise InvalidRequest(
                f"clip_skip must be a whole number from 0 to {self.max_clip_skip}, got {r.clip_skip!r}"
            )
        low, high = self.eta_range
        if not _number(r.eta) or not math.isfinite(r.eta) or not low <= r.eta <= high:
            raise InvalidRequest(
                f"eta must be a number from {low:g} (deterministic) to {high:g} (fresh noise at every step), "
                f"got {r.eta!r}"
            )
        self._check_deep_cache(r)
        self._check_token_merging(r)
        self._check_adapters(r)
        _check_encodes(self, r)
        _check_hires_options(self, r)  # before the images': hires_strength has become the strength
        _check_images(r)
        check_references(self, r)
        _check_picture_options(self, r)
        self._check_hires(r)

    def _check_size(self, r: GenerationRequest) -> None:
        m = self.side_multiple
        offered = None if self.sizes is None else ", ".join(size_label(w, h) for w, h in self.sizes)
        for name, side in (("height", r.height), ("width", r.width)):
            if not _whole(side) or side % m or not self.min_side <= side <= self.max_side:
                choose = f"; choose one of the sizes offered here: {offered}" if offered else ""
                raise InvalidRequest(
                    f"{name} must be a multiple of {m} from {self.min_side} to {self.max_side}, got {side!r}{choose}"
                )
        if self.sizes is not None and (r.width, r.height) not in self.sizes:
            raise InvalidRequest(f"size {size_label(r.width, r.height)} is not offered here; choose one of {offered}")

    def _check_token_merging(self, r: GenerationRequest) -> None:
        if _number(r.token_merging) and r.token_merging == 0:
            return
        if self.max_token_merging == 0:
            raise InvalidRequest(
                f"token_merging must be 0: this model's denoiser has no UNet levels to merge in, got {r.token_merging!r}"
            )
        if not _number(r.token_merging) or not 0 <= r.token_merging <= self.max_token_merging:
            raise InvalidRequest(
                f"token_merging must be a number from 0 (off) to {self.max_token_merging:g} (the share of the first "
                f"level's tokens merged before its self-attentions), got {r.token_merging!r}"
            )

    def _check_deep_cache(self, r: GenerationRequest) -> None:
        if _whole(r.deep_cache) and r.deep_cache in (0, 1):
            return
        if self.max_deep_cache == 0:
            raise InvalidRequest(
                f"deep_cache must be 0: this model's denoiser has no UNet levels to reuse, got {r.deep_cache!r}"
            )
        if not _whole(r.deep_cache) or not 0 <= r.deep_cache <= self.max_deep_cache:
            raise InvalidRequest(
                f"deep_cache must be a whole number from 0 (off) to {self.max_deep_cache} (a whole UNet pass every "
                f"that many steps), got {r.deep_cache!r}"
            )
        if r.controlled:
            raise InvalidRequest("deep_cache needs every UNet level at every step with a ControlNet: send 0")

    def _check_adapters(self, r: GenerationRequest) -> None:
        """The ControlNet's and the LoRAs' inputs: only what the server loaded, in range."""
        if r.control_image is not None:
            if not self.control:
                raise InvalidRequest(
                    "this server was started without a ControlNet (app.py --controlnet FOLDER_OR_HUB_ID); "
                    "send no control image"
                )
            if not isinstance(r.control_image, Image.Image):
                raise InvalidRequest(
                    f"control_image must be a picture (PIL.Image), got {type(r.control_image).__name__}"
                )
        low, high = self.control_scale_range
        scale = r.controlnet_conditioning_scale
        if not _number(scale) or not math.isfinite(scale) or not low <= scale <= high:
            raise InvalidRequest(
                f"controlnet_conditioning_scale must be a number from {low:g} to {high:g}, got {scale!r}"
            )
        if r.lora_scales is None:
            return
        if not isinstance(r.lora_scales, Mapping):
            raise InvalidRequest(f"lora_scales must map LoRA names to weights, got {type(r.lora_scales).__name__}")
        unknown = [name for name in r.lora_scales if name not in self.loras]
        if unknown:
            loaded = f"this server loaded: {', '.join(self.loras)}" if self.loras else "this server loaded none"
            raise InvalidRequest(f"unknown LoRA {', '.join(map(repr, unknown))}; {loaded} (app.py --lora NAME=PATH)")
        low, high = self.lora_scale_range
        for name, weight in r.lora_scales.items():
            if not _number(weight) or not math.isfinite(weight) or not low <= weight <= high:
                raise InvalidRequest(f"LoRA {name!r} weight must be a number from {low:g} to {high:g}, got {weight!r}")

    def _check_hires(self, r: GenerationRequest) -> None:
        if not r.hires:
            return
        if not self.upscalers:
            raise InvalidRequest("hires fix is not offered by this model here; send hires_scale 0")
        if r.image is not None or r.image_latents is not None:
            raise InvalidRequest("hires fix follows text to image only; send no image with hires_scale")
        low, high = self.hires_scale_range
        scale = r.hires_scale
        if not _number(scale) or not math.isfinite(scale) or not (scale == 0 or low <= scale <= high):
            raise InvalidRequest(f"hires_scale must be 0 (off) or a number from {low:g} to {high:g}, got {scale!r}")
        if r.hires_upscaler not in self.upscalers:
            raise InvalidRequest(
                f"unknown upscaler {r.hires_upscaler!r}; this server offers: {', '.join(self.upscalers)}"
            )
        if not _whole(r.hires_steps) or not 0 <= r.hires_steps <= self.max_steps:
            raise InvalidRequest(
                f"hires_steps must be a whole number from 0 (the first pass's steps) to {self.max_steps}, "
                f"got {r.hires_steps!r}"
            )
        for name, side in (("hires_width", r.hires_width), ("hires_height", r.hires_height)):
            if side is not None and not _whole(side):
                raise InvalidRequest(f"{name} must be a whole number of pixels, got {side!r}")
        width, height = r.hires_size()
        second = dataclasses.replace(r, width=width, height=height)
        try:
            self._check_size(second)
        except InvalidRequest as e:
            raise InvalidRequest(f"the hires pass's {e}") from None
        strength = HIRES_STRENGTH if r.strength is None else r.strength
        if int((r.hires_steps or r.num_inference_steps) * strength) < 1:
            raise InvalidRequest("hires fix's strength and steps run no step at all; raise the strength or the steps")

    def check_chunks(self, chunks: int, tokens: int, what: str = "prompt") -> None:
        """A tokenized prompt's length: more chunks than `max_chunks` is refused with the token budget."""
        if chunks > self.max_chunks:
            raise InvalidRequest(
                f"{what} is too long: {tokens} tokens need {chunks} chunks of 75; at most {self.max_chunks} chunks "
                f"({75 * self.max_chunks} tokens) are served, so shorten it or remove a BREAK"
            )


def _check_encodes(limits: Limits, r: GenerationRequest) -> None:
    """A VAE that reads no pictures (a tiny decoder alone) refuses the requests that bring one."""
    if limits.encodes:
        return
    given = (["image"] if r.image is not None else []) + (["references"] if r.references else [])
    if given:
        raise InvalidRequest(
            f"this server's VAE is a tiny VAE's decoder alone: it draws pictures but cannot read one, so send no "
            f"{' or '.join(given)} (image to image, inpainting and reference pictures need its encoder; the "
            "server takes both as --vae FOLDER holding the encoder file beside the decoder's)"
        )


def _check_images(r: GenerationRequest) -> None:
    """The image and mask are pictures of one size, and the strength runs at least one step."""
    if r.image is not None and not isinstance(r.image, Image.Image):
        raise InvalidRequest(f"image must be a picture (PIL.Image), got {type(r.image).__name__}")
    if r.mask_image is not None:
        if r.image is None:
            raise InvalidRequest("mask_image needs an image to paint into; give image too")
        if not isinstance(r.mask_image, Image.Image):
            raise InvalidRequest(f"mask_image must be a picture (PIL.Image), got {type(r.mask_image).__name__}")
        if r.mask_image.size != r.image.size:
            (mw, mh), (iw, ih) = r.mask_image.size, r.image.size
            raise InvalidRequest(
                f"mask_image is {mw}x{mh} but image is {iw}x{ih}; draw or upload the mask at the picture's size"
            )
    if r.strength is None:
        return
    s = r.strength
    if not _number(s) or not math.isfinite(s) or not 0 < s <= 1:
        raise InvalidRequest(f"strength must be a number above 0 and at most 1, got {s!r}")
    if (r.image is not None or r.image_latents is not None) and int(r.num_inference_steps * s) < 1:
        raise InvalidRequest(
            f"strength {s:g} of {r.num_inference_steps} steps runs no step at all; "
            f"raise the strength to at least {1 / r.num_inference_steps:g} or the steps"
        )


def _check_picture_options(limits: Limits, r: GenerationRequest) -> None:
    """A1111's image-to-image options: checked with or without a picture (clients send them on every call)."""
    if not _whole(r.resize_mode) or r.resize_mode not in RESIZE_MODES:
        modes = ", ".join(f"{k} ({name})" for k, name in RESIZE_MODES.items())
        raise InvalidRequest(f"resize_mode must be one of {modes}, got {r.resize_mode!r}")
    if r.mask_blur is not None and (not _whole(r.mask_blur) or not 0 <= r.mask_blur <= limits.max_mask_blur):
        raise InvalidRequest(
            f"mask_blur must be a whole number of pixels from 0 to {limits.max_mask_blur}, got {r.mask_blur!r}"
        )
    if not isinstance(r.inpaint_full_res, (bool, np.bool_)):
        raise InvalidRequest(f"inpaint_full_res must be true or false, got {r.inpaint_full_res!r}")
    padding = r.inpaint_full_res_padding
    if not _whole(padding) or not 0 <= padding <= limits.max_inpaint_padding:
        raise InvalidRequest(
            f"inpaint_full_res_padding must be a whole number of pixels from 0 to {limits.max_inpaint_padding}, "
            f"got {padding!r}"
        )
    if not _whole(r.inpainting_fill) or r.inpainting_fill not in FILLS:
        fills = ", ".join(f"{k} ({name})" for k, name in FILLS.items())
        raise InvalidRequest(f"inpainting_fill must be one of {fills}, got {r.inpainting_fill!r}")


def _check_hires_options(limits: Limits, r: GenerationRequest) -> None:
    """The second pass's own sampler, prompts and strength."""
    if r.hires_scheduler is not None and r.hires_scheduler not in limits.schedulers:
        raise InvalidRequest(
            f"unknown hires_scheduler {r.hires_scheduler!r}; choose one of {', '.join(limits.schedulers)} "
            "(or none: the first pass's)"
        )
    for name, text in (("hires_prompt", r.hires_prompt), ("hires_negative_prompt", r.hires_negative_prompt)):
        if text is not None and not isinstance(text, str):
            raise InvalidRequest(f"{name} must be text")
        if text is not None and len(text) > limits.max_prompt_chars:
            raise InvalidRequest(f"{name} is too long ({len(text)} characters; at most {limits.max_prompt_chars})")
    s = r.hires_strength
    if s is not None and (not _number(s) or not math.isfinite(s) or not 0 < s <= 1):
        raise InvalidRequest(f"hires_strength must be a number above 0 and at most 1, got {s!r}")


@dataclass
class GenerationResult:
    images: list[Image.Image]
    seeds: list[int]
    devices: list[str]
    timings: dict[str, float]  # queue_s, compile_s, run_s, total_s
    compiled: bool  # this request waited for a program to be compiled (loading one from the disk cache does not count)
    warnings: list[str] = field(default_factory=list)
    arrays: np.ndarray | None = None  # [n, h, w, 3] float32 in [0, 1], before rounding to 8 bits
    request: GenerationRequest | None = None  # complete: every default filled in
    nsfw_content_detected: list[bool] = field(default_factory=list)  # per picture: the safety checker withheld it
    latents: np.ndarray | None = None  # [n, h/8, w/8, c] the final scaled latents, when `return_latents` asked
