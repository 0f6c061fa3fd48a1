"""The Engine: the public face. Loads a model once, places it on a device mesh, warms up, serves requests.

Params are replicated over a `jax.sharding.Mesh` of every device (`P()`); image slots are sharded over
its `data` axis (`P('data')`). A request becomes a `Job` (token ids, schedule, seeds) and goes to the
`Batcher`, whose thread runs every request's images in shared batches (see engine/batcher.py);
compiled programs live in `Programs`, a bounded cache (engine/programs.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from PIL import Image

from .. import schedulers
from ..errors import InvalidRequest
from ..families.loader import LoadedModel, load_model_folder
from ..loading.controlnet import attach_controlnet, load_controlnet
from ..loading.lora import LoRAFactors, load_lora, lora_factors
from ..request import GenerationRequest, GenerationResult, Limits, common_sizes
from ..sampling import modes, pairs
from ..sampling.images import canny_image, control_image_array
from ..sampling.pipeline import Admission, Plan
from ..sampling.preview import PreviewMap, fit_preview
from ..sampling.prompts import TokenizedPrompt, align, tokenize_prompt
from .batcher import Batcher, Job
from .lora_serving import ServedLoRAs
from .programs import Programs, lane_widths
from .ticket import Progress, Ticket

log = logging.getLogger("jax-sd")

DEFAULT_MAX_BATCH_SIZE = 8  # image slots drawn at once over all devices


def enable_compile_cache(path: str | os.PathLike | None = None) -> Path:
    """Keeps compiled programs on disk (JAX_SD_CACHE_DIR, default ~/.cache/jax-sd/xla)."""
    path = Path(path or os.environ.get("JAX_SD_CACHE_DIR") or Path.home() / ".cache" / "jax-sd" / "xla")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _device_name(group) -> str:
    """ "cpu:0" for one device, "cpu:0+1" for a core pair."""
    return f"{group[0].platform}:" + "+".join(str(device.id) for device in group)


@dataclasses.dataclass
class Warmup:
    """The start-up compilation of the default shapes, which runs in the background."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    seconds: float | None = None
    error: str | None = None


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
        safety=None,
        loras: dict[str, LoRAFactors] | None = None,
        core_pairs: bool | None = None,
    ):
        """`sizes`: the (width, height) pairs served; "common" for the model's own and common aspect ratios,
        None for any size in range. `max_batch_size` is rounded up to a multiple of the device count.
        `core_pairs`: run each image on two CPU devices (engine/pairs.py); None: where `pair_cores()` asked
        for them in this process."""
        self.model = model
        self.family = model.family  # the family record's name: engine.families.FAMILIES
        self.label = model.label  # "Stable Diffusion XL Turbo"
        self.model_name = model.name
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
        self.loras = ServedLoRAs(loras or {}, replicated, keep=max_live_plans)  # see engine/lora_serving.py
        self.controlnet = model.controlnet  # its source, or None
        self.defaults = dict(model.defaults)
        self.variant = model.variant  # what the model is and which picture inputs it takes
        factor = model.vae_scale_factor
        self.limits = Limits(
            schedulers=schedulers.SCHEDULERS,
            side_multiple=factor,
            max_side=model.variant.max_side,
            max_clip_skip=model.max_clip_skip,
            devices=n,
            control=model.controlnet is not None,
            loras=self.loras.names,
        )
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
        # The safety checker (engine/safety.py), run in the decode program: "on", "off" or "none" (not shipped).
        self.safety_mode = "none" if safety is None else "on"
        checker = None if safety is None else (safety.graphdef, jax.device_put(safety.params, replicated))
        self.programs = Programs(
            model.graphdef, self.params, self._lanes, replicated, self._example, max_plans, checker=checker
        )
        self._blanks: dict[Plan, Job] = {}
        # Fitted once, in the background beside the warm-up (one small VAE decode, compiled unless cached):
        # a request's first preview may come a moment later, Ready never does.
        self._preview: Future | None = None
        if previews:
            self._preview = future = Future()
            fit = (model.graphdef, self.params, model.latent_channels, model.family)
            # Not a daemon: the interpreter waits for it at exit, rather than tear JAX down under it (a crash).
            threading.Thread(target=lambda: future.set_result(_fit_or_none(*fit)), name="jax-sd-preview").start()
        self.warmup_state = Warmup()
        self._batcher = Batcher(
            self.programs,
            self.params,
            self._blank,
            self.devices,
            self._lanes,
            chunk_steps=chunk_steps,
            max_waiting=max_waiting,
            max_live_plans=max_live_plans,
            preview=self._fitted_preview,
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
    def preview(self) -> PreviewMap | None:
        """The live previews' map, waited for if it is still being fitted; None with previews off (or if the
        fit failed: the log says why)."""
        return None if self._preview is None else self._preview.result()

    def _fitted_preview(self) -> PreviewMap | None:
        """The preview map if it is ready, without waiting."""
        done = self._preview is not None and self._preview.done()
        return self._preview.result() if done else None

    # -- requests -> jobs ------------------------------------------------------------------
    def prompts(self, r: GenerationRequest) -> tuple[TokenizedPrompt, TokenizedPrompt]:
        """The prompt and the negative prompt in 75-token chunks with their emphasis (engine/prompts.py),
        padded to one chunk count; refused when longer than `limits.max_chunks`."""
        prompt = tokenize_prompt(self.model.tokenizers, r.prompt)
        negative = tokenize_prompt(self.model.tokenizers, r.negative_prompt or "")
        self.limits.check_chunks(prompt.chunks, prompt.token_count)
        self.limits.check_chunks(negative.chunks, negative.token_count, "negative prompt")
        return prompt, negative

    def plan(self, r: GenerationRequest, chunks: int | None = None) -> Plan:
        """The static shapes of a complete request; `chunks`: its prompts' chunk count (None: tokenizes them)."""
        if chunks is None:
            chunks = max(p.chunks for p in self.prompts(r))
        factor = self.model.vae_scale_factor
        return Plan(
            batch=self.batch_size,
            latent_height=r.height // factor,
            latent_width=r.width // factor,
            scheduler=r.scheduler,
            max_steps=self.limits.max_steps,
            guidance=r.guided,
            family=self.family,
            clip_skip=int(r.clip_skip),
            chunks=chunks,
            devices=len(self.devices),
            control=r.controlled,
            mode=modes.mode_of(r.image, r.mask_image),
        )

    def _latent_shape(self, plan: Plan) -> tuple[int, int, int]:
        return (plan.latent_height, plan.latent_width, self.model.latent_channels)

    def _job(
        self, ticket: Ticket, r: GenerationRequest, plan: Plan, prompts: tuple[TokenizedPrompt, TokenizedPrompt]
    ) -> Job:
        prompt, negative = align(*prompts, chunks=plan.chunks)
        one = dataclasses.replace(plan, batch=1, devices=1)
        extra = {k: v[0] for k, v in self.model.extra_inputs(one, r.negative_prompt).items()}
        latents = None
        if r.latents is not None:
            want = (r.num_images, self.model.latent_channels, plan.latent_height, plan.latent_width)
            latents = np.asarray(r.latents, np.float32)
            if latents.shape != want:
                raise InvalidRequest(
                    f"latents must have shape {want} (images, channels, height/8, width/8), got {latents.shape}"
                )
            latents = latents.transpose(0, 2, 3, 1)  # NCHW -> NHWC
        tables = schedulers.tables(
            self.model.scheduler_config,
            r.scheduler,
            r.num_inference_steps,
            plan.max_steps,
            strength=None if plan.mode == "txt2img" else float(1.0 if r.strength is None else r.strength),
            inpaint=plan.mode == "inpaint",
        )
        return Job(
            ticket=ticket,
            plan=plan,
            ids=prompt.ids,
            weights=prompt.weights,
            neg_ids=negative.ids,
            neg_weights=negative.weights,
            extra=extra,
            tables=tables,
            seeds=r.image_seeds(),
            guidance_scale=float(r.guidance_scale),
            latents=latents,
            latent_shape=self._latent_shape(plan),
            control=self._control_image(r, plan),
            control_scale=float(r.controlnet_conditioning_scale),
            lora_weights=self.loras.weights(r.lora_scales),
            source=self._source(r, plan),
        )

    def _control_image(self, r: GenerationRequest, plan: Plan) -> np.ndarray | None:
        """[H, W, 3] in [0, 1], as the ControlNet pipeline preprocesses it; black for an empty slot."""
        if not plan.control:
            return None
        factor = self.model.vae_scale_factor
        height, width = plan.latent_height * factor, plan.latent_width * factor
        if r.control_image is None:
            return np.zeros((height, width, 3), np.float32)
        return control_image_array(r.control_image, height, width)[0]

    def canny_image(self, image, low: int = 100, high: int = 200):
        """The Canny edge map of a picture (white edges on black), the usual control image: for the page."""
        return canny_image(image, low, high)

    def _source(self, r: GenerationRequest, plan: Plan) -> modes.Source | None:
        """One image's picture and mask at the request's size (zeros for an empty slot); None for text-to-image."""
        if plan.mode == "txt2img":
            return None
        factor = self.model.vae_scale_factor
        width, height = plan.latent_width * factor, plan.latent_height * factor
        return modes.Source(**modes.source_row(r.image, r.mask_image, width, height))

    def _blank(self, plan: Plan) -> Job:
        """The job an empty slot holds: a schedule of no steps, so the slot never changes."""
        if plan not in self._blanks:
            r = GenerationRequest(
                "",
                "",
                num_inference_steps=1,
                guidance_scale=0.0,
                scheduler=plan.scheduler,
                num_images=1,
                height=1,
                width=1,
            )
            job = self._job(Ticket(r, []), r, plan, self.prompts(r))
            job.tables = dataclasses.replace(job.tables, num_loop_steps=np.int32(0))
            self._blanks[plan] = job
        return self._blanks[plan]

    def _example(self, plan: Plan) -> Admission:
        """An admission of empty slots: the shapes and dtypes the plan's programs take."""
        row = self._blank(plan)
        b = plan.batch
        stack = lambda a: np.stack([np.asarray(a)] * b)  # noqa: E731
        return Admission(
            mask=np.zeros(b, bool),
            ids=stack(row.ids),
            weights=stack(row.weights),
            neg_ids=stack(row.neg_ids),
            neg_weights=stack(row.neg_weights),
            extra={k: stack(v) for k, v in row.extra.items()},
            latents=np.zeros((b, *row.latent_shape), np.float32),
            given=np.zeros(b, bool),
            seeds=np.zeros(b, np.uint32),
            guidance_scale=np.zeros(b, np.float32),
            tables=jax.tree.map(stack, row.tables),
            **(dict(control=stack(row.control), control_scale=np.zeros(b, np.float32)) if plan.control else {}),
            source=jax.tree.map(stack, row.source),
        )

    def submit(self, request: GenerationRequest) -> Ticket:
        """Queues a request; returns at once with its Ticket. Raises InvalidRequest, or Busy when the queue is full."""
        if not isinstance(request, GenerationRequest):
            raise InvalidRequest(f"expected a GenerationRequest, got {type(request).__name__}")
        self.variant.check(request.image, request.mask_image)
        defaults = dict(self.defaults, strength=self.variant.default_strength(request.mask_image))
        r = self.limits.resolve(request, defaults, self.images_per_device)
        prompts = self.prompts(r)
        plan = self.plan(r, max(p.chunks for p in prompts))
        notes = [p.note(what) for p, what in zip(prompts, ("prompt", "negative prompt"), strict=True)]
        ticket = Ticket(r, [note for note in notes if note])
        self._batcher.submit(self._job(ticket, r, plan, prompts))
        return ticket

    def generate(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        seed: int = 0,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_images: int | None = None,
        scheduler: str | None = None,
        latents: np.ndarray | None = None,
        progress: Callable[[int, int], None] | None = None,
        clip_skip: int = 0,
        control_image=None,
        controlnet_conditioning_scale: float = 1.0,
        lora_scales: dict[str, float] | None = None,
        image: Image.Image | None = None,
        mask_image: Image.Image | None = None,
        strength: float | None = None,
    ) -> GenerationResult:
        """One request, waited for: the simple call. `clip_skip` k reads the text encoders k layers early.

        `control_image` (a PIL picture; a server with a ControlNet) steers every image, its residuals scaled by
        `controlnet_conditioning_scale`; `lora_scales` weighs the loaded LoRAs by name (left out: 1.0).
        `image`: start from this picture (image-to-image), noised to the step `strength` selects; with
        `mask_image` (white = repaint), only the white part is redrawn (inpainting). `latents` is then the
        noise mixed into the picture."""
        request = GenerationRequest(
            prompt=prompt,
            negative_prompt=negative_prompt,
            seed=seed,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            num_images=num_images,
            scheduler=scheduler,
            clip_skip=clip_skip,
            latents=latents,
            control_image=control_image,
            controlnet_conditioning_scale=controlnet_conditioning_scale,
            lora_scales=lora_scales,
            image=image,
            mask_image=mask_image,
            strength=strength,
        )
        ticket = self.submit(request)
        if progress is not None:
            ticket.subscribe(lambda e: progress(e.step, e.total) if isinstance(e, Progress) else None)
        return ticket.result()

    # -- start-up ---------------------------------------------------------------------------
    def warmup_plans(self, num_images: int | None = None) -> list[Plan]:
        """The default request's plan, then the same with guidance on or off the other way: moving the guidance
        slider across 1 compiles nothing once the second one is done."""
        g = self.defaults["guidance_scale"]
        plans = []
        for guidance in (g, 1.0 if g > 1 else 7.5):
            r = self.limits.resolve(
                GenerationRequest("", guidance_scale=guidance, num_images=num_images),
                self.defaults,
                self.images_per_device,
            )
            plans.append(self.plan(r))
        return plans

    def warmup(self, num_images: int | None = None, wait_for_all: bool = False) -> float:
        """Compiles the default request's programs (kept for good) and returns the seconds that took: from then
        on the default request never waits for a compiler. The rest, in the background: the other guidance
        plan, then the crowd's width of both (`wait_for_all` waits for them too)."""
        start, (default, other) = time.perf_counter(), self.warmup_plans(num_images)
        n = self.images_per_device if num_images is None else -(-num_images // default.devices)
        widths = lane_widths(default.slots_per_device)
        own = min(w for w in widths if w >= min(n, default.slots_per_device))
        # One plan at a time until Ready: XLA's CPU compiler already keeps two cores busy.
        self.programs.request(default, own, pin=True).result()
        seconds = time.perf_counter() - start
        rest = [self.programs.request(other, own, pin=True)]
        rest += [self.programs.request(plan, widths[-1]) for plan in (default, other)]
        if wait_for_all:
            for future in rest:
                future.result()
        return seconds

    def start_warmup(self, num_images: int | None = None) -> Engine:
        """`warmup` in a background thread; `ready` and `warmup_state` say how it went."""

        def run() -> None:
            try:
                self.warmup_state.seconds = self.warmup(num_images)
                log.info("warm-up finished in %.1f s", self.warmup_state.seconds)
            except Exception as e:  # the first request compiles instead; the engine stays up
                self.warmup_state.error = f"{type(e).__name__}: {e}"
                log.exception("warm-up failed")
            finally:
                self.warmup_state.done.set()

        threading.Thread(target=run, name="jax-sd-warmup", daemon=True).start()
        return self

    def close(self) -> None:
        self._batcher.close()
        self.programs.shutdown()


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


def load_pipeline(
    source: str | os.PathLike | None = None,
    dtype: str | None = None,
    images_per_device: int = 1,
    devices: list[jax.Device] | None = None,
    safety_checker: bool = True,
    controlnet: str | os.PathLike | None = None,
    loras: dict[str, str | os.PathLike] | None = None,
    **serving,
) -> Engine:
    """Loads a diffusers-format model (None: the embedded default; a folder; or a Hub id).

    `safety_checker`: run the folder's own safety checker on every picture, when it ships one (SD 1.x
    repositories do); False turns it off, for local use. `serving`: the Engine's options (max_batch_size,
    sizes, chunk_steps, max_waiting, max_plans, max_live_plans, previews). `controlnet`: a diffusers-format
    ControlNet folder or Hub id, run beside the UNet for requests with a control image. `loras`: name ->
    LoRA file, folder or Hub id (diffusers/PEFT or kohya layout), each refused at load if it does not fit.
    """
    dtype = dtype or default_dtype()
    model = load_model_folder(source, dtype)
    if controlnet is not None:
        model = attach_controlnet(model, load_controlnet(controlnet, dtype))
    factors = {name: lora_factors(load_lora(path), model.params) for name, path in (loras or {}).items()}
    checker = None
    if safety_checker:
        from ..loading.safety import load_safety_checker

        checker = load_safety_checker(source, dtype)
    engine = Engine(
        model, devices=devices, images_per_device=images_per_device, safety=checker, loras=factors, **serving
    )
    if not safety_checker:
        engine.safety_mode = "off"
    return engine
