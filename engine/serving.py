"""The Engine: loads a model once, places it on a device mesh, precompiles, serves requests.

Params are replicated over a `jax.sharding.Mesh` of every device (`P()`), the image batch is
sharded over its `data` axis (`P('data')`). Compiled programs are kept per `Plan`, so a new
prompt, seed, step count or guidance scale reuses them; JAX's persistent compilation cache
keeps them across restarts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from PIL import Image

from . import schedulers
from .loading import LoadedModel, load_model_folder
from .pipeline import Plan, decode, denoise, initial_latents, prepare

MAX_STEPS = 150
PROGRESS_UPDATES = 50  # at most this many progress reports (and loop calls) per request
MAX_SIDE = 2048
SEED_LIMIT = 2**32


_DISK_CACHE_HITS = [0]  # programs JAX loaded from its persistent cache instead of compiling


def _count_cache_hits(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _DISK_CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_cache_hits)


class InvalidRequest(ValueError):
    """Bad user input; the message says what to change."""


@dataclass
class GenerationResult:
    images: list[Image.Image]
    seeds: list[int]
    devices: list[str]
    timings: dict[str, float]
    compiled: bool  # a program was compiled for this call (loading one from the disk cache does not count)
    warnings: list[str] = field(default_factory=list)
    arrays: np.ndarray | None = None  # [n, h, w, 3] float32 in [0, 1], before rounding to 8 bits


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


def _device_name(device: jax.Device) -> str:
    return f"{device.platform}:{device.id}"


class Engine:
    """A loaded pipeline on every local device; `generate` is safe to call from many threads."""

    def __init__(self, model: LoadedModel, devices: list[jax.Device] | None = None, images_per_device: int = 1):
        self.model = model
        self.family = model.family  # "sd" or "sdxl"
        self.label = model.label  # "Stable Diffusion XL Turbo"
        self.model_name = model.name
        self.schedulers = schedulers.SCHEDULERS
        self.max_steps = MAX_STEPS
        self.example_prompts = list(model.example_prompts)
        self.images_per_device = images_per_device
        self._devices = list(devices or jax.devices())
        self.devices = [_device_name(d) for d in self._devices]
        self.mesh = Mesh(np.array(self._devices), ("data",))
        self._replicated = NamedSharding(self.mesh, P())
        self._batch = NamedSharding(self.mesh, P("data"))
        self.params = jax.device_put(model.params, self._replicated)
        self.defaults = dict(model.defaults)
        self._compiled: dict[tuple[Plan, str], Callable] = {}
        self._lock = threading.Lock()  # one generation at a time: the devices are shared
        self._noise = jax.jit(initial_latents, static_argnums=1, out_shardings=self._batch)
        self.compile_count = 0
        self._compiled_fresh = False  # the current request compiled (not just loaded) a program

    # -- validation ---------------------------------------------------------------------
    def _check(self, prompt, negative_prompt, seed, steps, guidance, height, width, num_images, scheduler, clip_skip):
        if not isinstance(prompt, str) or not isinstance(negative_prompt, str):
            raise InvalidRequest("prompt and negative prompt must be text")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
            raise InvalidRequest(f"seed must be a whole number from 0 to {SEED_LIMIT - 1}, got {seed!r}")
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= self.max_steps:
            raise InvalidRequest(f"steps must be a whole number from 1 to {self.max_steps}, got {steps!r}")
        if not isinstance(guidance, (int, float)) or not np.isfinite(guidance) or not 0 <= guidance <= 50:
            raise InvalidRequest(f"guidance scale must be a number from 0 to 50, got {guidance!r}")
        factor = self.model.vae_scale_factor
        for name, side in (("height", height), ("width", width)):
            if (
                isinstance(side, bool)
                or not isinstance(side, (int, np.integer))
                or side % factor
                or not factor <= side <= MAX_SIDE
            ):
                raise InvalidRequest(f"{name} must be a multiple of {factor} from {factor} to {MAX_SIDE}, got {side!r}")
        if isinstance(num_images, bool) or not isinstance(num_images, (int, np.integer)) or not 1 <= num_images <= 64:
            raise InvalidRequest(f"number of images must be from 1 to 64, got {num_images!r}")
        if scheduler not in self.schedulers:
            raise InvalidRequest(f"unknown scheduler {scheduler!r}; choose one of {', '.join(self.schedulers)}")
        top = self.model.max_clip_skip
        if isinstance(clip_skip, bool) or not isinstance(clip_skip, (int, np.integer)) or not 0 <= clip_skip <= top:
            raise InvalidRequest(f"clip_skip must be a whole number from 0 to {top}, got {clip_skip!r}")

    # -- compilation --------------------------------------------------------------------
    def _plan(self, num_images, height, width, scheduler, guidance, clip_skip) -> Plan:
        factor, n_dev = self.model.vae_scale_factor, len(self._devices)
        batch = -(-num_images // n_dev) * n_dev  # pad up to a multiple of the device count
        latent_h, latent_w, steps = height // factor, width // factor, self.max_steps
        return Plan(batch, latent_h, latent_w, scheduler, steps, guidance > 1.0, self.family, int(clip_skip))

    @property
    def compiled_plans(self) -> list[Plan]:
        """The static shapes compiled so far, oldest first."""
        return [plan for plan, stage in self._compiled if stage == "prepare"]

    def _compiled_call(self, plan: Plan, name: str, fn: Callable, *args, out_shardings=None):
        """Runs stage `name` of `plan`, compiling it ahead of time on first use; returns (outputs, seconds compiling)."""
        program = self._compiled.get((plan, name))
        compile_s = 0.0
        if program is None:
            start, hits = time.perf_counter(), _DISK_CACHE_HITS[0]
            jitted = jax.jit(fn, static_argnums=(0, 1), out_shardings=out_shardings)
            program = jitted.lower(plan, self.model.graphdef, *args).compile()
            self._compiled[(plan, name)] = program
            compile_s = time.perf_counter() - start
            self._compiled_fresh |= _DISK_CACHE_HITS[0] == hits  # not loaded from disk: really compiled
        return program(*args), compile_s

    def _run(self, plan: Plan, args, progress: Callable[[int, int], None] | None) -> tuple[np.ndarray, float]:
        """prepare -> denoise (in chunks when reporting progress) -> decode; returns images and compile seconds."""
        params, ids, neg_ids, extra, latents, seeds, tables, guidance = args
        if (plan, "prepare") not in self._compiled:
            self.compile_count += 1  # counts plans: each compiles its three programs once
        (cond, x, state), c1 = self._compiled_call(
            plan, "prepare", prepare, params, ids, neg_ids, extra, latents, tables
        )
        total = int(tables.num_loop_steps)
        # Without progress the loop is one call; with it, at most PROGRESS_UPDATES calls, each
        # queued before waiting on the one before, so the device never waits for the host.
        chunk = total if progress is None else -(-total // PROGRESS_UPDATES)
        bounds = [*range(0, total, chunk), total]
        compile_s, pending = c1, None
        for a, b in zip(bounds, bounds[1:], strict=False):
            a, b = (jax.device_put(np.int32(v), self._replicated) for v in (a, b))
            # The loop's outputs keep its inputs' layout, so that each chunk feeds the next one.
            carry_shardings = jax.tree.map(lambda v: v.sharding, (x, state))
            (x, state), c2 = self._compiled_call(
                plan,
                "denoise",
                denoise,
                params,
                cond,
                x,
                state,
                seeds,
                tables,
                guidance,
                a,
                b,
                out_shardings=carry_shardings,
            )
            compile_s += c2
            if progress is not None:
                if pending is not None:
                    pending[0].block_until_ready()
                    progress(pending[1], total)
                pending = (x, int(b))
        images, c3 = self._compiled_call(plan, "decode", decode, params, x)
        if pending is not None:
            pending[0].block_until_ready()
            progress(pending[1], total)
        return np.asarray(images), compile_s + c3

    def _inputs(
        self, plan: Plan, prompt: str, negative_prompt: str, seeds: np.ndarray, steps: int, guidance: float, latents
    ):
        ids, warnings = self.model.tokenize(prompt)
        neg_ids, neg_warnings = self.model.tokenize(negative_prompt, what="negative prompt")
        ids = np.broadcast_to(ids, (plan.batch, *ids.shape[1:]))  # [batch, 77] or [batch, encoders, 77]
        neg_ids = np.broadcast_to(neg_ids, (plan.batch, *neg_ids.shape[1:]))
        extra = self.model.extra_inputs(plan, negative_prompt)
        seeds_dev = jax.device_put(seeds, self._batch)
        if latents is None:
            shape = (plan.latent_height, plan.latent_width, self.model.latent_channels)
            latents = self._noise(seeds_dev, shape)
        else:
            latents = jax.device_put(latents, self._batch)
        tables = schedulers.tables(self.model.scheduler_config, plan.scheduler, steps, plan.max_steps)
        put = lambda x: jax.device_put(x, self._batch)  # noqa: E731
        args = (
            self.params,
            put(ids.astype(np.int32)),
            put(neg_ids.astype(np.int32)),
            jax.tree.map(put, extra),
            latents,
            seeds_dev,
            jax.device_put(tables, self._replicated),
            jax.device_put(jnp.float32(guidance), self._replicated),
        )
        return args, warnings + neg_warnings

    # -- the public face ----------------------------------------------------------------
    def warmup(self, num_images: int | None = None, height: int | None = None, width: int | None = None) -> float:
        """Compiles the default shapes ahead of the first request, with guidance on and off; returns seconds.

        Guidance on (scale > 1) and off are two programs, so both are built: moving the guidance
        slider across 1 must not compile while a user waits.
        """
        start = time.perf_counter()
        for guidance in (self.defaults["guidance_scale"], 1.0 if self.defaults["guidance_scale"] > 1 else 7.5):
            self.generate(
                "", num_inference_steps=1, num_images=num_images, height=height, width=width, guidance_scale=guidance
            )
        return time.perf_counter() - start

    def generate(
        self,
        prompt: str,
        negative_prompt: str = "",
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
    ) -> GenerationResult:
        """One batch of images. `clip_skip` k reads the text encoders k layers before their usual output."""
        d = self.defaults
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        guidance = d["guidance_scale"] if guidance_scale is None else guidance_scale
        height = d["height"] if height is None else height
        width = d["width"] if width is None else width
        num_images = len(self._devices) * self.images_per_device if num_images is None else num_images
        scheduler = d["scheduler"] if scheduler is None else scheduler
        self._check(prompt, negative_prompt, seed, steps, guidance, height, width, num_images, scheduler, clip_skip)
        plan = self._plan(num_images, height, width, scheduler, float(guidance), clip_skip)
        seeds = (np.arange(plan.batch, dtype=np.uint64) + int(seed)) % SEED_LIMIT
        if latents is not None:
            want = (num_images, self.model.latent_channels, plan.latent_height, plan.latent_width)
            latents = np.asarray(latents, np.float32)
            if latents.shape != want:
                raise InvalidRequest(
                    f"latents must have shape {want} (images, channels, height/8, width/8), got {latents.shape}"
                )
            latents = latents.transpose(0, 2, 3, 1)  # NCHW -> NHWC
            pad = plan.batch - num_images
            latents = np.concatenate([latents, np.zeros((pad, *latents.shape[1:]), np.float32)]) if pad else latents
        with self._lock:
            start = time.perf_counter()
            args, warnings = self._inputs(
                plan, prompt, negative_prompt, seeds.astype(np.uint32), steps, float(guidance), latents
            )
            run_start = time.perf_counter()
            self._compiled_fresh = False
            images, compile_s = self._run(plan, args, progress)
            images = images[:num_images]
            run_s = time.perf_counter() - run_start - compile_s
        per_device = plan.batch // len(self._devices)
        return GenerationResult(
            images=[Image.fromarray(np.round(img * 255).astype(np.uint8)) for img in images],
            seeds=[int(s) for s in seeds[:num_images]],
            devices=[self.devices[k // per_device] for k in range(num_images)],
            timings={"compile_s": compile_s, "run_s": run_s, "total_s": time.perf_counter() - start},
            compiled=self._compiled_fresh,
            warnings=warnings,
            arrays=images,
        )


def load_pipeline(
    source: str | os.PathLike | None = None,
    dtype: str | None = None,
    images_per_device: int = 1,
    devices: list[jax.Device] | None = None,
) -> Engine:
    """Loads a diffusers-format model (None: the embedded default; a folder; or a Hub id)."""
    model = load_model_folder(source, dtype or default_dtype())
    return Engine(model, devices=devices, images_per_device=images_per_device)
