"""Each field of a `GenerationRequest`, described once: what it means, its type, default and range, its names at
every door (AUTOMATIC1111's body or settings, PNG parameters, OpenAI's extra body, ComfyUI's graph) and where it
sits on the page.

The doors derive what they show from `FIELDS`: the page's controls and `/generate`'s parameters (web/page.py), the
REST parser (web/requests.py), the A1111 and OpenAI body models (web/a1111_models.py, web/openai_images.py), PNG
parameters written and read back (compat/pnginfo.py), MCP's tool schema (from `/generate`) and the history entry.
What a door does that is truly its own stays there: A1111's batch_size x n_iter and sampler names, OpenAI's
`size`, the page's size dropdown and seed box. `Limits.check` stays the one validator; a field's range here
only says where it comes from (a number, or the name of a `Limits` attribute), for the controls that show it.

A new request field is one record here, its field on `GenerationRequest` and its use in the engine. The doors read
`FIELDS` when they are built, never at import, so a server built after a change of `FIELDS` shows the change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The page's sections: above the fold, the "Advanced", "Hires fix", picture modes' and adapters' accordions.
SECTIONS = ("basic", "advanced", "hires", "picture", "adapters")
REMEMBERED = ("basic", "advanced", "hires")  # a history entry, a live drawing and a dropped picture's recipe hold these


@dataclass(frozen=True)
class OnPage:
    """Where a field sits on the page and how it is set there."""

    section: str  # one of SECTIONS
    control: str  # "slider", "dropdown" (choices from the range's Limits attribute), "checkbox", or the page's own
    label: str
    step: float | None = None
    name: str | None = None  # the page's (and `/generate`'s) name for it, where it is not the field's own
    minimum: float | None = None  # the slider's low end, where the range's own is open ("above 0")
    value: Any = None  # the control's starting value, where it is not the field's default (mask blur 4, as A1111's)


@dataclass(frozen=True)
class RequestField:
    """One field of the request. `range`: (low, high), each a number or the name of a `Limits` attribute, or the
    name of one `Limits` attribute holding (low, high) or the choices; None: no range of its own."""

    name: str  # `GenerationRequest`'s and `engine.generate`'s name
    type: type  # int, float, str, or the door's own kind (a picture, a mapping)
    default: Any  # None: the model's own (or, for a picture, none)
    meaning: str  # one line, for people: the page's and MCP's description
    range: tuple[float | str, float | str] | str | None = None
    title: str = ""  # how a refusal names it at the page ("Steps"); the API names it by its field name
    page: OnPage | None = None
    a1111: str | None = None  # the name in A1111's txt2img / img2img body
    a1111_setting: str | None = None  # the name in A1111's `override_settings` (it wins over the body's)
    a1111_default: Any = None  # A1111's value where its body leaves the field out, when it is not ours (mask_blur 4)
    png: str | None = None  # the key in PNG parameters (A1111's infotext)
    png_by_scheduler: tuple[tuple[str, str], ...] = ()  # (scheduler, key) where A1111 writes another key for one
    openai: str | None = None  # the name in OpenAI's body, as an extra field
    comfy: tuple[str, str] | None = None  # ComfyUI's graph: (the node's role, its input): ("sampler", "steps")
    needs_image: bool = False  # only with a picture: A1111's img2img, OpenAI's edits, PNG only then
    written: Callable[[Any], bool] | None = None  # PNG: written when this holds (default: set and not the default)
    to_a1111: Callable[[Any], Any] | None = None  # ours -> A1111's value, in its body and in PNG parameters
    from_a1111: Callable[[Any], Any] | None = None  # A1111's value -> ours

    @property
    def page_name(self) -> str:
        return (self.page.name if self.page else None) or self.name

    def bounds(self, limits: Any) -> tuple[Any, Any]:
        """(low, high) on these limits."""
        if isinstance(self.range, str):
            return tuple(getattr(limits, self.range))
        low, high = self.range
        return tuple(getattr(limits, end) if isinstance(end, str) else end for end in (low, high))

    def choices(self, limits: Any) -> tuple:
        return tuple(getattr(limits, self.range))

    def png_key(self, scheduler: str | None) -> str | None:
        return dict(self.png_by_scheduler).get(scheduler, self.png)

    def png_keys(self) -> tuple[str, ...]:
        """Every key it is read back from, the specific ones first (A1111 writes "Eta DDIM" for DDIM)."""
        return tuple(dict.fromkeys([key for _, key in self.png_by_scheduler] + [self.png]))

    def is_written(self, value: Any) -> bool:
        if self.written is not None:
            return self.written(value)
        return value is not None and value != self.default


def _clip_skip_to_a1111(layers: int) -> int:
    return int(layers) + 1  # A1111's CLIP_stop_at_last_layers: 1 is the last layer, 2 one before it


def _clip_skip_from_a1111(stop_at: int) -> int:
    return max(int(stop_at) - 1, 0)  # 0 and 1 both mean the last layer


FIELDS: tuple[RequestField, ...] = (
    RequestField(
        "prompt",
        str,
        "",
        "what the picture should show, in English words.",
        title="Prompt",
        page=OnPage("basic", "textbox", "Prompt"),
        a1111="prompt",
        openai="prompt",
    ),
    RequestField(
        "negative_prompt",
        str,
        None,
        "what to keep out of the picture; empty for none.",
        title="Negative prompt",
        page=OnPage("basic", "textbox", "Negative prompt"),
        a1111="negative_prompt",
        openai="negative_prompt",
    ),
    RequestField(
        "seed",
        int,
        0,
        "the random seed of the first picture (picture k uses seed + k); ignored when random_seed is true.",
        range=(0, 2**32 - 1),  # engine.SEED_LIMIT - 1: seeds are uint32
        title="Seed",
        page=OnPage("basic", "number", "Seed"),
        a1111="seed",
        png="Seed",
        openai="seed",
        comfy=("sampler", "seed"),
        written=lambda seed: seed is not None,
    ),
    RequestField(
        "num_inference_steps",
        int,
        None,
        "denoising steps; more is slower and usually finer.",
        range=(1, "max_steps"),
        title="Steps",
        page=OnPage("basic", "slider", "Steps", step=1, name="steps"),
        a1111="steps",
        png="Steps",
        openai="num_inference_steps",
        comfy=("sampler", "steps"),
    ),
    RequestField(
        "guidance_scale",
        float,
        None,
        "how closely to follow the prompt (classifier-free guidance); 1 or less turns it off.",
        range="guidance_range",
        title="Guidance scale",
        page=OnPage("basic", "slider", "Guidance scale", step=0.5),
        a1111="cfg_scale",
        png="CFG scale",
        openai="guidance_scale",
        comfy=("sampler", "cfg"),
    ),
    RequestField(
        "scheduler",
        str,
        None,
        "the sampler: pndm, ddim, euler, euler_a, dpm++2m, dpm++2m_karras, lcm or tcd.",
        range="schedulers",
        title="Scheduler",
        page=OnPage("advanced", "dropdown", "Scheduler"),
        openai="scheduler",  # A1111 names samplers its own way (web/names.py); PNG: "Sampler", "Schedule type"
    ),
    RequestField(
        "width", int, None, "the picture's width in pixels.", a1111="width", comfy=("latent", "width")
    ),  # the page: its size
    RequestField(
        "height", int, None, "the picture's height in pixels.", a1111="height", comfy=("latent", "height")
    ),  # OpenAI: `size`
    RequestField(
        "num_images", int, None, "how many pictures; default: one per device.", comfy=("latent", "batch_size")
    ),  # A1111 and OpenAI count their own
    RequestField(
        "strength",
        float,
        None,
        "with a picture, how much is redrawn, above 0 and at most 1 (hires fix's second pass too).",
        range=(0.0, 1.0),
        title="Strength",
        page=OnPage("picture", "slider", "Strength (how much of the picture is redrawn)", step=0.05, minimum=0.05),
        a1111="denoising_strength",
        png="Denoising strength",
        openai="strength",
        comfy=("sampler", "denoise"),
        needs_image=True,
    ),
    RequestField(
        "clip_skip",
        int,
        0,
        "read the text encoder this many layers before its last.",
        range=(0, "max_clip_skip"),
        a1111="clip_skip",  # SD.Next's field; A1111's own is the setting
        a1111_setting="CLIP_stop_at_last_layers",
        png="Clip skip",
        openai="clip_skip",
        to_a1111=_clip_skip_to_a1111,
        from_a1111=_clip_skip_from_a1111,
    ),
    RequestField(
        "eta",
        float,
        0.0,
        "the sampler's stochasticity: DDIM's eta (0: deterministic), TCD's gamma; the others take none.",
        range="eta_range",
        a1111="eta",
        png="Eta",
        png_by_scheduler=(("ddim", "Eta DDIM"),),  # A1111's `eta_infotext_field` for DDIM
        openai="eta",
    ),
    RequestField(
        "deep_cache",
        int,
        0,
        "DeepCache: a whole UNet pass every this many steps, only its first level between (faster, a slightly "
        "different picture); 0 or 1: every step whole.",
        range=(0, "max_deep_cache"),
        title="Deep cache",
        page=OnPage(
            "advanced",
            "slider",
            "Deep cache: a whole UNet pass every N steps, its first level alone between (0: off)",
            1,
        ),
        png="Deep cache",
        openai="deep_cache",
        written=lambda interval: interval is not None and interval > 1,  # 1 is every step whole, as 0
    ),
    RequestField(
        "token_merging",
        float,
        0.0,
        "the share of the first UNet level's tokens merged into similar ones before its self-attentions (ToMe: "
        "faster, a slightly different picture); 0: off.",
        range=(0.0, "max_token_merging"),
        title="Token merging ratio",
        page=OnPage(
            "advanced", "slider", "Token merging ratio: the share of the first level's tokens merged (0: off)", 0.05
        ),
        a1111_setting="token_merging_ratio",
        png="Token merging ratio",
        openai="token_merging",
    ),
    RequestField(
        "hires_scale",
        float,
        0.0,
        "hires fix: draw the picture again at this many times its size, from the first one upscaled; 0: off.",
        range="hires_scale_range",
        title="Hires upscale",
        page=OnPage("hires", "slider", "Upscale by (0: off)", step=0.25, minimum=0.0),
        a1111="hr_scale",
        png="Hires upscale",
        openai="hires_scale",
    ),
    RequestField(
        "hires_width",
        int,
        None,
        "hires fix: the second pass's width (the height keeps the aspect unless given too); none: by the scale.",
        a1111="hr_resize_x",
        png="Hires resize-1",
        openai="hires_width",
    ),
    RequestField(
        "hires_height",
        int,
        None,
        "hires fix: the second pass's height (the width keeps the aspect unless given too); none: by the scale.",
        a1111="hr_resize_y",
        png="Hires resize-2",
        openai="hires_height",
    ),
    RequestField(
        "hires_upscaler",
        str,
        "Latent",
        "hires fix: how the first picture is upscaled: a latent mode (Latent, Latent (bicubic), ...) or a picture's.",
        range="upscalers",
        title="Hires upscaler",
        page=OnPage("hires", "dropdown", "Upscaler"),
        a1111="hr_upscaler",
        png="Hires upscaler",
        openai="hires_upscaler",
    ),
    RequestField(
        "hires_steps",
        int,
        0,
        "hires fix: the second pass's steps, of which strength runs its share; 0: the first pass's.",
        range=(0, "max_steps"),
        title="Hires steps",
        page=OnPage("hires", "slider", "Hires steps (0: as the first pass)", step=1),
        a1111="hr_second_pass_steps",
        png="Hires steps",
        openai="hires_steps",
    ),
    RequestField(
        "hires_scheduler",
        str,
        None,
        "hires fix: the second pass's sampler (as scheduler); none: the first pass's.",
        range="schedulers",
        title="Hires sampler",
        png="Hires sampler",  # by A1111's sampler name (compat/pnginfo.py)
        openai="hires_scheduler",  # A1111's hr_sampler_name is read with its sampler names (web/names.py)
    ),
    RequestField(
        "hires_prompt",
        str,
        None,
        "hires fix: the second pass's prompt; none: the first pass's.",
        title="Hires prompt",
        a1111="hr_prompt",
        png="Hires prompt",
        openai="hires_prompt",
    ),
    RequestField(
        "hires_negative_prompt",
        str,
        None,
        "hires fix: the second pass's negative prompt; none: the first pass's.",
        title="Hires negative prompt",
        a1111="hr_negative_prompt",
        png="Hires negative prompt",
        openai="hires_negative_prompt",
    ),
    RequestField(
        "hires_strength",
        float,
        None,
        "hires fix: how much the second pass redraws, above 0 and at most 1; none: strength's, else 0.7.",
        range=(0.0, 1.0),
        title="Hires denoising strength",
        page=OnPage("hires", "slider", "Denoising strength", step=0.05, minimum=0.05, value=0.7),  # A1111's
        openai="hires_strength",  # A1111 sends txt2img's denoising_strength (strength)
    ),
    RequestField(
        "resize_mode",
        int,
        0,
        "a picture of another size than the request's: 0 just resize, 1 crop and resize (cover, the middle kept), "
        "2 resize and fill (fit, the edges stretched over the rest), 3 just resize (A1111 resizes the latents).",
        range=(0, 3),
        title="Resize mode",
        a1111="resize_mode",
        openai="resize_mode",
        needs_image=True,
    ),
    RequestField(
        "mask_blur",
        int,
        None,
        "inpainting: blur the mask's edge by this many pixels (a Gaussian's sigma) and lay the picture back over "
        "the drawing through it, as A1111 does; none: the drawing as the model makes it.",
        range=(0, "max_mask_blur"),
        title="Mask blur",
        page=OnPage("picture", "slider", "Mask blur (pixels; 0: a sharp edge)", step=1, minimum=0, value=4),
        a1111="mask_blur",
        a1111_default=4,
        png="Mask blur",
        openai="mask_blur",
        needs_image=True,
        written=lambda sigma: sigma is not None and sigma > 0,  # A1111 writes it only when it blurs
    ),
    RequestField(
        "inpaint_full_res",
        bool,
        False,
        "inpainting: draw only the masked area (its box and the padding, at the request's size), then paste it "
        "back into the whole picture (A1111's 'Only masked').",
        title="Only masked",
        page=OnPage("picture", "checkbox", "Only masked: draw the masked area at the full size, paste it back"),
        a1111="inpaint_full_res",
        a1111_default=True,
        openai="inpaint_full_res",
        needs_image=True,
    ),
    RequestField(
        "inpaint_full_res_padding",
        int,
        32,
        "with inpaint_full_res: pixels around the mask's box drawn with it.",
        range=(0, "max_inpaint_padding"),
        title="Only masked padding",
        page=OnPage("picture", "slider", "Only masked padding (pixels)", step=4),
        a1111="inpaint_full_res_padding",
        a1111_default=0,
        openai="inpaint_full_res_padding",
        needs_image=True,
    ),
    RequestField(
        "inpainting_fill",
        int,
        1,
        "inpainting: what the masked area starts from: 0 the colours around it blurred in, 1 the picture, "
        "2 latent noise, 3 latent zeros (A1111's 'Masked content').",
        range=(0, 3),
        title="Masked content",
        page=OnPage("picture", "slider", "Masked content: 0 fill, 1 original, 2 latent noise, 3 latent nothing", 1),
        a1111="inpainting_fill",
        a1111_default=0,
        openai="inpainting_fill",
        needs_image=True,
    ),
    RequestField(
        "control_image",
        object,
        None,
        "a picture that steers the drawing (servers started with --controlnet only).",
        page=OnPage("adapters", "image", "Control picture"),
    ),
    RequestField(
        "controlnet_conditioning_scale",
        float,
        1.0,
        "how strongly the control picture steers, 0 to 2.",
        range="control_scale_range",
        title="Conditioning scale",
        page=OnPage("adapters", "slider", "Conditioning scale", step=0.05),
    ),
    RequestField(
        "lora_scales",
        dict,
        None,
        "the server's LoRAs by name -> weight (a LoRA left out keeps 1.0).",
        range="lora_scale_range",
        page=OnPage("adapters", "json", "LoRA weights"),  # A1111 and OpenAI: `<lora:name:weight>` in the prompt
    ),
    RequestField("image", object, None, "start from this picture (image to image)."),  # each door its own upload
    RequestField("mask_image", object, None, "white: repaint (inpainting); at the picture's size."),
    RequestField(  # each door its own upload (OpenAI's edits image[], A1111's init_images, the page's Edit mode)
        "references",
        object,
        (),
        "reference pictures the model edits from or draws beside, for models that edit: FLUX.2 [klein].",
        range=(0, "max_references"),  # how many
    ),
    RequestField("latents", object, None, "the starting noise, [n, c, h/8, w/8]; for scripts, not the doors."),
    RequestField("image_latents", object, None, "start from these scaled latents [1, h/8, w/8, c]; for scripts."),
    RequestField("return_latents", bool, False, "hand the final latents back in the result; for scripts."),
    RequestField(
        "model",
        str,
        None,
        "which of the server's models draws (a title, name or hash as /sdapi/v1/sd-models lists them); none: the "
        "server's default.",
        a1111_setting="sd_model_checkpoint",  # OpenAI's `model` and the page's model dropdown are their doors' own
    ),
)


def by_name(fields: tuple[RequestField, ...] | None = None) -> dict[str, RequestField]:
    return {f.name: f for f in (FIELDS if fields is None else fields)}


def current() -> tuple[RequestField, ...]:
    """The description as it stands now (the doors call this when they are built)."""
    return FIELDS
