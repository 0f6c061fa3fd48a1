"""The Engine: the public face. Loads a model once, places it on a device mesh, warms up, serves requests.

Params are replicated over a `jax.sharding.Mesh` of every device (`P()`); image slots are sharded over
its `data` axis (`P('data')`). A request becomes a `Job` (token ids, schedule, seeds) and goes to the
`Batcher`, whose thread runs every request's images in shared batches (see engine/serving/batcher.py);
compiled programs live in `Programs`, a bounded cache (engine/serving/programs.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from PIL import Image

from .. import schedulers
from ..errors import InvalidRequest
from ..families import FAMILIES
from ..families.loader import LoadedModel
from ..loading.lora import LoRAFactors
from ..loading.quantize import computes_in_int8
from ..loading.upscaler_folder import UpscalerFolder
from ..loading.vae import vae_encodes
from ..nn import int8, onednn
from ..request import GenerationRequest, GenerationResult, Limits, common_sizes
from ..sampling import pairs
from ..sampling.hires import LATENT_UPSCALERS
from ..sampling.images import canny_image
from ..sampling.pipeline import Plan
from ..sampling.preview import DecodedPreview, Previewer, PreviewMap, fit_preview
from ..sampling.prompts import TokenizedPrompt
from ..sampling.upscale import upscale_to
from .batcher import Batcher
from .hires import HiresFix, first_pass
from .jobs import Jobs, reference_limits
from .lora_serving import ServedLoRAs
from .prepared import needs_preparing, submit_prepared
from .programs import Programs
from .slots import Job
from .ticket import Progress, Ticket
from .warmup import Warmup, start_in_background, warmup_plans
from .warmup import warmup as compile_warmup

MAX_DEEP_CACHE = 10  # the longest DeepCache interval a request may ask for: a whole UNet pass every 10 steps
MAX_TOKEN_MERGING = 0.75  # the largest token merging ratio a request may ask for (tomesd's own upper advice)

log = logging.getLogger("jax-sd")

DEFAULT_MAX_BATCH_SIZE = 8  # image slots drawn at once over all devices


def _run_dtype(params) -> str:
    """The dtype the networks run in: that of their largest floating-point array (a denoiser's kernel)."""
    floats = [a for a in jax.tree.leaves(params) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]
    return str(max(floats, key=lambda a: a.size).dtype) if floats else "float32"


def _device_name(group) -> str:
    """ "cpu:0" for one device, "cpu:0+1" for a core pair."""
    return f"{group[0].platform}:" + "+".join(str(device.id) for device in group)


def _model_limits(model: LoadedModel, factor: int, devices: int, loras: tuple, upscalers: tuple) -> Limits:
    """What a model's requests may ask for; `factor`: one denoiser token's pixels."""
    denoiser = FAMILIES[model.family].denoiser
    unet_levels = denoiser.denoise_shallow is not None  # DeepCache, token merging
    encodes = vae_encodes(model.params)
    return Limits(
        schedulers=schedulers.compatible(model.scheduler_config),  # a flow model's kinds, or the others
        side_multiple=factor,
        max_side=model.variant.max_side,
        max_clip_skip=model.max_clip_skip,
        devices=devices,
        control=model.controlnet is not None,
        loras=loras,
        max_deep_cache=MAX_DEEP_CACHE if unet_levels else 0,
        max_token_merging=MAX_TOKEN_MERGING if unet_levels else 0.0,
        # Hires fix redraws a text-to-image picture as image to image: not for a model that only repaints; with a
        # VAE that reads no pictures (a tiny decoder alone), from the latents only.
        upscalers=() if model.variant.needs else (*LATENT_UPSCALERS, *(upscalers if encodes else ())),
        **reference_limits(denoiser.references),  # a model that edits takes reference pictures
        encodes=encodes,
    )


class Engine:
    """A loaded pipeline on every local device; `submit` and `generate` are safe to call from many threads."""

    def __init__(
        self,
        model: LoadedModel,
        devices: list[jax.Device] | None = None,
        images_per_device: int = 1,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        sizes: list[tuple[int, int]] | str | None = None,
        chunk_steps: int = 1,
        max_waiting: int = 256,
        max_plans: int = 8,
        max_live_plans: int = 2,
        previews: bool = True,
        preview_every_s: float = 0.3,
        safety=None,
        loras: dict[str, LoRAFactors] | None = None,
        core_pairs: bool | None = None,
        upscalers: UpscalerFolder | None = None,
    ):
        """`upscalers`: hires fix's picture upscalers beside the latent ones (default: Lanczos and Nearest).
        `sizes`: the (width, height) pairs served; "common" for the model's own and common aspect ratios,
        None for any size in range. `max_batch_size` is rounded up to a multiple of the device count.
        `preview_every_s`: a request's live previews come at most this often.
        `core_pairs`: run each image on two CPU devices (engine/sampling/pairs.py); None: where `pair_cores()` asked
        for them in this process."""
        self.model = model
        self.upscalers = upscalers or UpscalerFolder()  # hires fix's and the Extras' picture upscalers
        self._upscaling = threading.Lock()
        self.family = model.family  # the family record's name: engine.families.FAMILIES
        self.label = model.label  # "Stable Diffusion XL Turbo"
        self.model_name = model.name
        self.vae_name = model.vae  # which VAE draws: "the model's own VAE", or the folder or Hub id given
        self.example_prompts = list(model.example_prompts)
        self.images_per_device = images_per_device
        self._devices = list(devices or jax.devices())
        if core_pairs is None:
            core_pairs = pairs.asked() and pairs.paired(self._devices)
        if core_pairs and not pairs.paired(self._devices):
            raise ValueError(f"core pairs need an even number of CPU devices, not {self._devices}")
        self.core_pairs = core_pairs
        # A data group: the devices one image runs on (a core pair, or one device).
        groups = np.array(self._devices).reshape(-1, 2 if core_pairs else 1)
        self.devices = [_device_name(group) for group in groups]
        n = len(groups)
        self.batch_size = -(-max(1, max_batch_size) // n) * n
        self.mesh = Mesh(groups, (pairs.DATA, pairs.PAIR)) if core_pairs else Mesh(groups[:, 0], (pairs.DATA,))
        self._lanes = NamedSharding(self.mesh, P(pairs.DATA))
        replicated = NamedSharding(self.mesh, P())
        self.params = jax.device_put(model.params, replicated)
        self._pinned = onednn.pin(self.params, int8_values=int8.kernel_values(self.params))  # reordered once
        self.dtype = _run_dtype(self.params)  # "float32", "bfloat16" or "float16": the networks' own
        # For people (the page's details, the APIs' options): the dtype and what computes the products here.
        platform = self._devices[0].platform
        self.compute_path = onednn.compute_path(self.dtype, platform, int8=computes_in_int8(self.params))
        slow = onednn.slow_half(self.dtype, platform)
        log.log(logging.WARNING if slow else logging.INFO, "compute path: %s", self.compute_path)
        self.loras = ServedLoRAs(loras or {}, replicated, keep=max_live_plans)  # see engine/lora_serving.py
        self.controlnet = model.controlnet  # its source, or None
        # Textual inversion embeddings a prompt may call by name: `.loaded` (name, vectors, encoders), `.skipped`
        # (name -> why) and `.a1111()`, A1111's /sdapi/v1/embeddings (engine/loading/textual_inversion.py)
        self.embeddings = model.embeddings
        self.defaults = dict(model.defaults)
        self.guided = model.guided  # False: a step-distilled model (FLUX.2 [klein]), which ignores the guidance scale
        self.variant = model.variant  # what the model is and which picture inputs it takes
        factor = model.vae_scale_factor * model.patch_size  # one denoiser token's pixels
        self.limits = _model_limits(model, factor, n, self.loras.names, self.upscalers.names())
        if sizes == "common":
            sizes = common_sizes(self.defaults["width"], factor, self.limits.min_side)
        if sizes is not None:
            self.limits = dataclasses.replace(self.limits, sizes=tuple((int(w), int(h)) for w, h in sizes))
            for w, h in self.limits.sizes:  # the server's own configuration: refused at start, not per request
                self.limits.check(
                    GenerationRequest(
                        "",
                        num_inference_steps=1,
                        guidance_scale=0.0,
                        height=h,
                        width=w,
                        num_images=1,
                        scheduler=self.defaults["scheduler"],
                    )
                )
            # A request without a size (and the warm-up) takes the default size: where the model's own is not
            # offered, the offered one nearest it in aspect, then area, else every such request would be refused.
            own = Image.new("1", (self.defaults["width"], self.defaults["height"]))
            self.defaults["width"], self.defaults["height"] = self.limits.image_size(own)
        self.jobs = Jobs(model, self.limits, self.loras, self.batch_size, len(self.devices))
        # The safety checker (engine/models/safety.py), run in the decode program: "on", "off" or "none" (not shipped).
        self.safety_mode = "none" if safety is None else "on"
        checker = None if safety is None else (safety.graphdef, jax.device_put(safety.params, replicated))
        self.programs = Programs(
            model.graphdef, self.params, self._lanes, replicated, self.jobs.example, max_plans, checker=checker
        )
        self._preview = _start_previews(model, self.params) if previews else None
        self.warmup_state = Warmup()
        self._batcher = Batcher(
            self.programs,
            self.params,
            self.jobs.blank,
            self.devices,
            self._lanes,
            chunk_steps=chunk_steps,
            max_waiting=max_waiting,
            max_live_plans=max_live_plans,
            preview=self._fitted_preview,
            preview_every_s=preview_every_s,
            params_for=lambda weights: self.loras.params(self.params, weights),
        )
        # The scheduler thread must not be mid-call into JAX while the interpreter shuts down.
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- what the page reads ---------------------------------------------------------------
    @property
    def schedulers(self) -> tuple[str, ...]:
        return self.limits.schedulers

    @property
    def max_steps(self) -> int:
        return self.limits.max_steps

    @property
    def compile_count(self) -> int:
        """Plans compiled (or loaded from the disk cache) so far; each is a set of programs."""
        return self.programs.compile_count

    @property
    def compiled_plans(self) -> list[Plan]:
        """The static shapes compiled and held now, least recently used first."""
        return self.programs.plans

    @property
    def ready(self) -> bool:
        return self.warmup_state.done.is_set()

    @property
    def preview(self) -> Previewer | None:
        """What draws the live previews: the fitted latent-to-RGB map (waited for if it is still being fitted),
        or `DecodedPreview` with a tiny autoencoder (the VAE's own pictures); None with previews off (or if the
        fit failed: the log says why)."""
        return None if self._preview is None else self._preview.result()

    def _fitted_preview(self) -> Previewer | None:
        """What draws the previews if it is ready, without waiting."""
        done = self._preview is not None and self._preview.done()
        return self._preview.result() if done else None

    # -- requests -> jobs (engine/serving/jobs.py) -------------------------------------------
    def prompts(self, r: GenerationRequest) -> tuple[TokenizedPrompt, TokenizedPrompt]:
        """The prompt and the negative prompt in 75-token chunks with their emphasis, padded to one chunk count."""
        return self.jobs.prompts(r)

    def plan(self, r: GenerationRequest, chunks: int | None = None) -> Plan:
        """The static shapes of a complete request; `chunks`: its prompts' chunk count (None: tokenizes them)."""
        return self.jobs.plan(r, chunks)

    def _job(self, ticket: Ticket, r: GenerationRequest, plan: Plan, prompts) -> Job:
        return self.jobs.job(ticket, r, plan, prompts)

    def canny_image(self, image, low: int = 100, high: int = 200):
        """The Canny edge map of a picture (white edges on black), the usual control image: for the page."""
        return canny_image(image, low, high)

    def submit(self, request: GenerationRequest, caller: str = "") -> Ticket:
        """Queues a request; returns at once with its Ticket. Raises InvalidRequest, or Busy when the queue is full.
        `caller`: who asks; waiting requests are admitted in callers' turns (batcher.py: `in_turns`)."""
        if not isinstance(request, GenerationRequest):
            raise InvalidRequest(f"expected a GenerationRequest, got {type(request).__name__}")
        self.variant.check(
            request.image if request.image_latents is None else request.image_latents, request.mask_image
        )
        defaults = dict(self.defaults, strength=self.variant.default_strength(request.mask_image))
        r = self.limits.resolve(request, defaults, self.images_per_device)
        if r.hires:  # two passes, each an ordinary request (serving/hires.py)
            first = self._submit(first_pass(r), caller)
            ticket = Ticket(r, first.warnings, caller)
            HiresFix(r, ticket, self._submit_second, self.upscale).start(first)
            return ticket
        if needs_preparing(r):  # A1111's resize modes, mask blur, "only masked", fill (serving/prepared.py)
            return submit_prepared(r, self._submit, caller)
        return self._submit(r, caller)

    def _submit_second(self, r: GenerationRequest, caller: str) -> Ticket:
        """Hires fix's second pass of one picture: checked as any image-to-image request, then queued."""
        return self._submit(self.limits.resolve(r, self.defaults, self.images_per_device), caller)

    def _submit(self, r: GenerationRequest, caller: str = "") -> Ticket:
        """A resolved request to the batcher."""
        prompts, fit = self.prompts(r), self.jobs.fit(r)
        plan = self.jobs.plan(r, max(p.chunks for p in prompts), fit)
        notes = [p.note(what) for p, what in zip(prompts, ("prompt", "negative prompt"), strict=True)]
        ticket = Ticket(r, [note for note in notes if note] + list(fit.notes), caller)
        self._batcher.submit(self.jobs.job(ticket, r, plan, prompts))
        return ticket

    def add_loras(self, factors: dict[str, LoRAFactors]) -> None:
        """LoRAs served from now on (matched to the model by `lora.lora_factors`); earlier requests weigh them 0."""
        self.loras.add(factors)
        self.limits = self.jobs.limits = dataclasses.replace(self.limits, loras=self.loras.names)

    def upscale(self, picture: Image.Image, width: int, height: int, upscaler: str) -> Image.Image:
        """A picture at width x height through one of this server's upscalers ("Lanczos", "Nearest" or a network of
        `upscalers`), as A1111's Extras upscale it; one at a time (it takes the CPUs the drawings use). Refused by
        name: an unknown upscaler, a size past the guard (sampling/upscale.py)."""
        with self._upscaling:
            return upscale_to(picture, width, height, self.upscalers.get(upscaler))

    def generate(self, prompt: str, progress: Callable[[int, int], None] | None = None, **fields) -> GenerationResult:
        """One request, waited for: the simple call. Every keyword is the `GenerationRequest` field of that name
        (`engine.request_fields` says what each means; None: the model's default); `progress(step, total)` is
        called as the denoising goes. `help(Engine.generate)` lists them with their defaults."""
        request = GenerationRequest(prompt, **fields)  # an unknown keyword is a TypeError, as in any call
        ticket = self.submit(request)
        if progress is not None:
            ticket.subscribe(lambda e: progress(e.step, e.total) if isinstance(e, Progress) else None)
        return ticket.result()

    # -- start-up (engine/serving/warmup.py) ---------------------------------------------------
    def warmup_plans(self, num_images: int | None = None) -> list[Plan]:
        """The default request's plan, then the same with guidance the other way."""
        return warmup_plans(self.jobs, self.limits, self.defaults, self.images_per_device, num_images)

    def warmup(self, num_images: int | None = None, wait_for_all: bool = False) -> float:
        """Compiles the default request's programs and returns the seconds that took; the rest in the background."""
        plans = self.warmup_plans(num_images)
        wait = self._batcher.idle.wait
        return compile_warmup(self.programs, plans, self.images_per_device, num_images, wait_for_all, wait)

    def start_warmup(self, num_images: int | None = None) -> Engine:
        """`warmup` in a background thread; `ready` and `warmup_state` say how it went."""
        start_in_background(self.warmup_state, lambda: self.warmup(num_images))
        return self

    def close(self) -> None:
        """Stops the batcher and waits for this engine's background work (a compile under way, the preview fit):
        nothing of a closed engine runs on, to race whatever the process does next."""
        self._batcher.close()
        self.programs.shutdown()
        if self._preview is not None:
            futures.wait([self._preview], timeout=300)
        self._pinned.release()


def _start_previews(model: LoadedModel, params) -> Future:
    """What will draw the live previews. The map is fitted once, in the background beside the warm-up (one small
    VAE decode, compiled unless cached): a request's first preview may come a moment later, Ready never does.
    A tiny autoencoder needs no fit: it decodes the previews itself, in each batch's decode program."""
    future: Future = Future()
    if model.tiny_vae:
        future.set_result(DecodedPreview())
        return future
    fit = (model.graphdef, params, model.latent_channels, model.family)
    # Not a daemon: the interpreter waits for it at exit, rather than tear JAX down under it (a crash).
    threading.Thread(target=lambda: future.set_result(_fit_or_none(*fit)), name="jax-sd-preview").start()
    return future


def _fit_or_none(*args) -> PreviewMap | None:
    try:
        return fit_preview(*args)
    except Exception:  # previews are a nicety: the engine serves on without them
        log.exception("fitting the preview map failed; no live previews")
        return None


def _close_if_alive(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


def _generate_signature() -> inspect.Signature:
    """`generate`'s keywords: the request's fields after the prompt, with their defaults, and `progress`."""
    kind = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
        inspect.Parameter("progress", kind, default=None),
    ]
    for f in dataclasses.fields(GenerationRequest)[1:]:
        default = f.default if f.default is not dataclasses.MISSING else None
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    return inspect.Signature(params, return_annotation="GenerationResult")


Engine.generate.__signature__ = _generate_signature()
