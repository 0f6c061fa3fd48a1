"""diffusers' Flax pipelines kept alive on our engine: `FlaxStableDiffusionPipeline`, `FlaxStableDiffusionXLPipeline`.

diffusers 0.40 deleted them. Code written for them runs here once its import line reads
`from engine.compat.flax_api import FlaxStableDiffusionPipeline` (or `FlaxStableDiffusionXLPipeline`, or a scheduler).
The calls are the old ones: `from_pretrained` returns `(pipeline, params)`, `prepare_inputs` tokenizes, and
`pipeline(prompt_ids, params, prng_seed, ..., jit=True)` runs `jax.pmap` over inputs sharded with
`flax.training.common_utils.shard` and params replicated with `flax.jax_utils.replicate`;
`jax.pmap(pipeline._generate)` works as diffusers' how-to shows. Underneath are our models and schedulers,
which match diffusers' PyTorch pipelines, reading the repository's safetensors.

As in the old pipelines, classifier-free guidance always runs (unconditional half first, the scale traced),
and the initial noise is `jax.random.normal(key, [batch, channels, h, w])` on each device, NCHW, drawn with
JAX's pre-0.5 bits (`_old_normal`), so that a key gives the noise it gave the old pipeline.
Unlike them, the step count is not static: step counts up to `_max_steps(n)` share one program.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import schedulers
from ..families import FAMILIES, sd, sdxl
from ..families.loader import LoadedModel, load_model_folder
from ..sampling.pipeline import Plan, decode
from .flax_api_schedulers import (
    GONE_SCHEDULERS,
    FlaxDDIMScheduler,
    FlaxDPMSolverMultistepScheduler,
    FlaxEulerAncestralDiscreteScheduler,
    FlaxEulerDiscreteScheduler,
    FlaxPNDMScheduler,
    FlaxScheduler,
    FlaxSchedulerState,
    for_kind,
)

log = logging.getLogger("jax-sd")

# Hub revisions (and variants) that held Flax msgpack weights; their repositories' safetensors load instead.
FLAX_REVISIONS = ("bf16", "flax", "refs/pr/95")
# from_pretrained keywords of the old API that mean nothing here (downloads go through HF_HOME's cache).
IGNORED_KEYWORDS = frozenset(
    "cache_dir resume_download force_download proxies local_files_only token use_auth_token mirror"
    " use_memory_efficient_attention low_cpu_mem_usage output_loading_info requires_safety_checker _do_init".split()
)
COMPONENTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet", "vae")
_MODELS = "engine.models.clip.CLIPTextModel, engine.models.unet.UNet2DConditionModel and engine.models.vae.AutoencoderKL (Flax NNX)"
# Old names with no counterpart here, and what to use instead.
GONE = {
    **GONE_SCHEDULERS,
    "FlaxStableDiffusionImg2ImgPipeline": "diffusers' PyTorch StableDiffusionImg2ImgPipeline (no image-to-image here)",
    "FlaxStableDiffusionInpaintPipeline": "diffusers' PyTorch StableDiffusionInpaintPipeline (no inpainting here)",
    "FlaxStableDiffusionControlNetPipeline": "diffusers' PyTorch StableDiffusionControlNetPipeline (no ControlNet here)",
    "FlaxDiffusionPipeline": "FlaxStableDiffusionPipeline or FlaxStableDiffusionXLPipeline",
    "FlaxUNet2DConditionModel": f"{_MODELS}, which engine.families.loader.load_model_folder builds from a diffusers folder",
    "FlaxAutoencoderKL": f"{_MODELS}, which engine.families.loader.load_model_folder builds from a diffusers folder",
}
_GONE_ATTRIBUTES = {
    **dict.fromkeys(COMPONENTS[:2] + COMPONENTS[4:], f"params[...] holds their weights; the models are {_MODELS}"),
    **dict.fromkeys(
        ("_get_has_nsfw_concepts", "_run_safety_checker"),
        "the folder's own safety checker runs inside the pipeline call (engine.models.safety)",
    ),
    "save_pretrained": "the folder it was loaded from is already in diffusers format: copy that folder",
    "to": "JAX places arrays itself: use jax.device_put on params",
    "components": "params (the weights) and the pipeline's tokenizer and scheduler",
}


def __getattr__(name: str) -> Any:
    if name in GONE:  # `from engine.compat.flax_api import FlaxLMSDiscreteScheduler` fails with this message
        raise ImportError(f"{name} is not provided by engine.compat.flax_api: use {GONE[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static part of a call: changing a field compiles a new program (the step count does not)."""

    family: str
    kind: str  # scheduler kind, engine.schedulers
    height: int
    width: int
    vae_scale_factor: int
    channels: int
    max_steps: int
    output_latents: bool = False

    @property
    def latent_shape(self) -> tuple[int, int, int]:  # NCHW without the batch, as the old pipelines drew it
        return (self.channels, self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)


def _max_steps(n: int) -> int:
    """Step counts share the program of their power-of-two bucket (at least 64): the tables are padded to it."""
    return max(64, 1 << (n - 1).bit_length())


def _old_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    # JAX 0.5 turned `jax_threefry_partitionable` on, which changed the bits behind every key; the old
    # pipelines ran before that, so their pictures come from the old bits.
    with jax.threefry_partitionable(False):
        return jax.random.normal(key, shape, jnp.float32)


def _generate(
    graphdef: nnx.GraphDef,
    spec: _Spec,
    weights: dict,
    ids: jax.Array,
    neg_ids: jax.Array | None,
    key: jax.Array,
    guidance: jax.Array,
    latents: jax.Array | None,
    tables: schedulers.Tables,
) -> jax.Array:
    """One device's images [b, H, W, 3] in [0, 1] (or its final latents [b, c, h, w]), traceable.

    ids [b, 77] (SDXL: [b, 2, 77]); neg_ids alike, or None (SDXL: zero embeddings, as the old pipeline);
    key: one PRNG key; guidance [b], [1] or []; latents: None or [b, c, h, w] unscaled noise, NCHW.
    """
    models = nnx.merge(graphdef, nnx.State(weights))
    b, (channels, h, w) = ids.shape[0], spec.latent_shape
    plan = Plan(
        batch=b,
        latent_height=h,
        latent_width=w,
        scheduler=spec.kind,
        max_steps=spec.max_steps,
        guidance=True,
        family=spec.family,
    )
    family = FAMILIES[spec.family]
    # SDXL: uncropped micro-conditioning at the generated size, as the old pipeline; no negative ids: zeros.
    extra = family.text.extra_inputs({}, spec.vae_scale_factor, None, None)(plan, "", None if neg_ids is None else "")
    encode = family.text.encode
    halves = (
        encode(models, ids if neg_ids is None else neg_ids, extra, plan, True),
        encode(models, ids, extra, plan, False),
    )
    cond = jax.tree.map(lambda u, c: jnp.concatenate([u, c]), *halves)  # [2b, ...], unconditional first
    g = jnp.reshape(jnp.asarray(guidance, jnp.float32), (-1, 1, 1, 1))
    noise = _old_normal(key, (b, channels, h, w)) if latents is None else latents
    x = jnp.transpose(noise.astype(jnp.float32), (0, 2, 3, 1)) * tables.init_noise_sigma  # NCHW -> NHWC

    def body(i, carry):
        x, state = carry
        model_in = schedulers.scale_model_input(spec.kind, tables, i, x)
        t = schedulers.timestep(tables, i)
        out = models.unet(jnp.concatenate([model_in, model_in]), t, cond.context, cond.text_embeds, cond.time_ids)
        uncond, text = jnp.split(out.astype(jnp.float32), 2)
        eps = uncond + g * (text - uncond)
        fresh = _old_normal(jax.random.fold_in(key, i + 1), x.shape) if schedulers.stochastic(spec.kind) else None
        return schedulers.step(spec.kind, tables, state, i, eps, x, fresh)

    state = schedulers.init_state(spec.kind, x)
    x, _ = jax.lax.fori_loop(0, tables.num_loop_steps, body, (x, state))
    if spec.output_latents:
        return jnp.transpose(x, (0, 3, 1, 2))
    return decode(plan, graphdef, nnx.State(weights), x)


@dataclasses.dataclass
class _Output:
    """diffusers' BaseOutput, as far as old code used it: `.images`, `[0]`, `["images"]`, `to_tuple()`."""

    images: np.ndarray

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __getitem__(self, index: int | str) -> Any:
        return getattr(self, index) if isinstance(index, str) else self.to_tuple()[index]


@dataclasses.dataclass
class FlaxStableDiffusionPipelineOutput(_Output):
    nsfw_content_detected: list[bool] = dataclasses.field(default_factory=list)  # per picture: the checker flagged it


@dataclasses.dataclass
class FlaxStableDiffusionXLPipelineOutput(_Output):
    pass


def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype or np.float32).name
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {name} is not supported: use jnp.float32, jnp.bfloat16 or jnp.float16")
    return name


def _source(name: str | Path, revision: str | None, variant: str | None, dtype: str) -> str | Path:
    is_folder = Path(name).expanduser().is_dir()
    if revision in FLAX_REVISIONS or variant in FLAX_REVISIONS:
        log.warning(
            "%s: revision/variant %r held Flax weights, which this engine does not read; loading the "
            "repository's safetensors (main branch) in %s instead",
            name,
            revision if revision in FLAX_REVISIONS else variant,
            dtype,
        )
    elif variant is not None:
        log.warning("%s: variant %r ignored: the weights are chosen by dtype (fp16 files for 16 bits)", name, variant)
    if revision not in (None, "main", *FLAX_REVISIONS) and not is_folder:
        raise ValueError(
            f"revision {revision!r} of {name}: only the main branch loads here. Download it "
            f"(`hf download {name} --revision {revision} --local-dir DIR`) and pass DIR instead"
        )
    return name


class _FlaxPipeline:
    """What the two old pipelines share; `family` and `prepare_inputs` tell them apart."""

    family: ClassVar[str]
    _ids_rank: ClassVar[int]  # axes of one prompt's token ids: [77] or [encoders, 77]

    def __init__(self, model: LoadedModel, scheduler: FlaxScheduler, dtype: Any):
        self.dtype = dtype
        self.scheduler = scheduler
        self.safety_checker = self.feature_extractor = None
        self.tokenizer = model.tokenizers[0].inner  # transformers' CLIPTokenizer, as before
        self.vae_scale_factor = model.vae_scale_factor
        self.name = model.name
        self._tokenizers = [t.inner for t in model.tokenizers]
        if len(self._tokenizers) > 1:
            self.tokenizer_2 = self._tokenizers[1]
        self._default_side = (model.denoiser_config.sample_size or 64) * model.vae_scale_factor
        self._side_multiple = model.vae_scale_factor * 2 ** (len(model.denoiser_config.block_out_channels) - 1)
        self._channels = model.denoiser_config.in_channels
        weights = nnx.to_pure_dict(model.params)
        self._treedef = jax.tree.structure(weights)
        self._leaf_ndim = np.ndim(jax.tree.leaves(weights)[0])
        self._graphdef = model.graphdef
        core = functools.partial(_generate, model.graphdef)
        self._single = jax.jit(core, static_argnums=0)  # static: the _Spec
        self._sharded = jax.pmap(core, in_axes=(None, 0, 0, 0, 0, 0, 0, None), static_broadcasted_argnums=0)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *,
        dtype: Any = jnp.float32,
        revision: str | None = None,
        variant: str | None = None,
        scheduler: FlaxScheduler | None = None,
        safety_checker: Any = "folder",
        feature_extractor: Any = None,
        from_pt: bool | None = None,
        split_head_dim: bool | None = None,
        **kwargs: Any,
    ) -> tuple[_FlaxPipeline, dict[str, Any]]:
        """(pipeline, params) from a diffusers folder or Hub id; params: {component: weights, "scheduler": state}.

        `dtype` is that of the params (f32 by default, as the old pipelines loaded them), and the models compute
        in the dtype of the params they are given. from_pt, split_head_dim and feature_extractor mean nothing here.
        """
        for name in kwargs:
            if name in COMPONENTS:
                raise ValueError(
                    f"passing {name}= is not supported: save the pipeline with it as a diffusers folder "
                    "(save_pretrained) and load that folder"
                )
            if name not in IGNORED_KEYWORDS:
                raise TypeError(f"{cls.__name__}.from_pretrained() got an unexpected keyword argument {name!r}")
        if safety_checker not in ("folder", None):
            raise ValueError(
                "passing a safety checker object is not supported: by default the folder's own safety_checker/ "
                "runs (engine.models.safety); safety_checker=None turns it off"
            )
        if scheduler is not None and not isinstance(scheduler, FlaxScheduler):
            raise TypeError(
                f"scheduler={type(scheduler).__name__}: pass one of engine.compat.flax_api's schedulers, e.g. "
                "FlaxDPMSolverMultistepScheduler.from_pretrained(model_id, subfolder='scheduler')[0]"
            )
        name = _dtype_name(dtype)
        model = load_model_folder(_source(pretrained_model_name_or_path, revision, variant, name), name)
        if model.family != cls.family:
            other = {c.family: c.__name__ for c in _FlaxPipeline.__subclasses__()}[model.family]
            raise ValueError(f"{model.name} is a {model.label} model: load it with {other}")
        scheduler = scheduler or for_kind(model.defaults["scheduler"], model.scheduler_config)
        params: dict[str, Any] = nnx.to_pure_dict(model.params)
        params["scheduler"] = scheduler.create_state()
        pipeline = cls(model, scheduler, dtype)
        if safety_checker == "folder":  # as the old pipelines: the repository's own checker, when it ships one
            from ..loading.safety import load_safety_checker

            pipeline.safety_checker = load_safety_checker(
                _source(pretrained_model_name_or_path, revision, variant, name)
            )
        return pipeline, params

    def __getattr__(self, name: str) -> Any:
        if name in _GONE_ATTRIBUTES:
            raise AttributeError(f"{type(self).__name__}.{name} is not provided here: {_GONE_ATTRIBUTES[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def prepare_inputs(self, prompt: str | list[str]) -> np.ndarray:
        """Token ids, padded and cut to 77: [n, 77] (SDXL: [n, 2, 77]); a str counts as one prompt."""
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"`prompt` has to be of type `str` or `list` but is {type(prompt)}")
        rows = [
            tok(prompt, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True).input_ids
            for tok in self._tokenizers
        ]
        ids = np.asarray(rows, np.int32).reshape(len(rows), -1, self.tokenizer.model_max_length)  # [encoders, n, 77]
        return ids[0] if self._ids_rank == 1 else ids.transpose(1, 0, 2)

    @staticmethod
    def numpy_to_pil(images: np.ndarray) -> list:
        """[n, H, W, 3] (or [H, W, 3]) in [0, 1] -> a list of PIL images."""
        from PIL import Image

        images = np.asarray(images, np.float32)
        images = (images[None] if images.ndim == 3 else images) * 255
        images = images.round().astype(np.uint8)
        if images.shape[-1] == 1:
            return [Image.fromarray(image[..., 0], mode="L") for image in images]
        return [Image.fromarray(image) for image in images]

    def _generate(
        self,
        prompt_ids: jax.Array,
        params: Mapping[str, Any],
        prng_seed: jax.Array,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale: float | jax.Array = 7.5,
        latents: jax.Array | None = None,
        neg_prompt_ids: jax.Array | None = None,
        return_latents: bool = False,
    ) -> jax.Array:
        """One device's images [b, H, W, 3], traceable: `jax.pmap(pipeline._generate)(ids, params, keys)` works."""
        spec, tables, weights = self._prepare(params, num_inference_steps, height, width, return_latents, devices=None)
        self._check_inputs(prompt_ids, neg_prompt_ids, prng_seed, latents, spec, jit=False)
        neg = self._negative(prompt_ids, neg_prompt_ids)
        return _generate(self._graphdef, spec, weights, prompt_ids, neg, prng_seed, guidance_scale, latents, tables)

    def _run(
        self,
        prompt_ids: Any,
        params: Mapping[str, Any],
        prng_seed: Any,
        *,
        steps: int,
        height: int | None,
        width: int | None,
        guidance_scale: Any,
        latents: Any,
        neg_prompt_ids: Any,
        jit: bool,
        output_latents: bool,
    ) -> np.ndarray:
        """The images (or latents) of a call, on the host: one program per device with jit, else one program."""
        lead = self._lead(prompt_ids)
        if len(lead) != (2 if jit else 1):
            raise ValueError(
                f"prompt_ids {tuple(np.shape(prompt_ids))}: with jit=True they are sharded, [devices, per_device, "
                "...] (flax.training.common_utils.shard), with jit=False they are [n, ...] as prepare_inputs gives"
            )
        spec, tables, weights = self._prepare(params, steps, height, width, output_latents, lead[0] if jit else None)
        self._check_inputs(prompt_ids, neg_prompt_ids, prng_seed, latents, spec, jit)
        if np.ndim(guidance_scale) == 0:  # one scale per image, sharded like the prompts
            guidance_scale = np.full(lead, guidance_scale, np.float32)
        neg = self._negative(prompt_ids, neg_prompt_ids)
        run = self._sharded if jit else self._single
        return np.asarray(run(spec, weights, prompt_ids, neg, prng_seed, guidance_scale, latents, tables))

    def _lead(self, ids: Any) -> tuple[int, ...]:
        return tuple(np.shape(ids))[: -self._ids_rank]

    def _negative(self, ids: Any, neg_ids: Any) -> Any:
        return neg_ids  # SDXL: None means zero embeddings; SD overrides

    def _prepare(
        self, params: Any, steps: int, height: int | None, width: int | None, raw: bool, devices: int | None
    ) -> tuple[_Spec, schedulers.Tables, dict]:
        """The static spec, the host tables and the weights of a call, each checked; devices: None unless jit."""
        if not isinstance(params, Mapping):
            raise TypeError(f"params is a {type(params).__name__}: pass the dict from from_pretrained")
        state = params.get("scheduler")
        state = self.scheduler.create_state() if state is None else state
        if not isinstance(state, FlaxSchedulerState):
            raise TypeError(
                f"params['scheduler'] is a {type(state).__name__}: use the state from engine.compat.flax_api's schedulers "
                "(FlaxPNDMScheduler.from_pretrained(model_id, subfolder='scheduler') returns (scheduler, state))"
            )
        if state != self.scheduler.create_state():
            raise ValueError(
                f"params['scheduler'] runs {state.kind!r} but the pipeline's scheduler is {self.scheduler!r}: pass "
                "scheduler= to from_pretrained (or set pipeline.scheduler) with the scheduler of that state"
            )
        weights = {k: v for k, v in params.items() if k != "scheduler"}
        if jax.tree.structure(weights) != self._treedef:
            raise ValueError(
                f"params do not fit this pipeline: pass the params that from_pretrained returned for {self.name}"
            )
        leaf = jax.tree.leaves(weights)[0]
        if devices is not None and (np.ndim(leaf) != self._leaf_ndim + 1 or np.shape(leaf)[0] != devices):
            raise ValueError(
                f"jit=True runs a copy on each of {devices} devices: pass flax.jax_utils.replicate(params)"
            )
        if devices is None and np.ndim(leaf) != self._leaf_ndim:
            raise ValueError("params are replicated: pass jit=True with sharded inputs, or the unreplicated params")
        height, width = height or self._default_side, width or self._default_side
        if height % 8 or width % 8:
            raise ValueError(f"`height` and `width` have to be divisible by 8 but are {height} and {width}.")
        if height % self._side_multiple or width % self._side_multiple:
            raise ValueError(f"this model needs `height` and `width` divisible by {self._side_multiple}")
        n = operator.index(steps)  # a Python int, static in the old API too
        tables = schedulers.tables(state.config, state.kind, n, _max_steps(n))
        spec = _Spec(self.family, state.kind, height, width, self.vae_scale_factor, self._channels, _max_steps(n), raw)
        return spec, tables, weights

    def _check_inputs(self, ids: Any, neg: Any, key: Any, latents: Any, spec: _Spec, jit: bool) -> None:
        lead = self._lead(ids)
        if neg is not None and np.shape(neg) != np.shape(ids):
            raise ValueError(f"neg_prompt_ids {np.shape(neg)} must be shaped like prompt_ids {np.shape(ids)}")
        typed = hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        key_lead = tuple(np.shape(key))[: np.ndim(key) - (0 if typed else 1)] if hasattr(key, "dtype") else None
        if key_lead != lead[: 1 if jit else 0]:
            raise ValueError(
                f"jit=True takes one key per device: jax.random.split(jax.random.PRNGKey(seed), {lead[0]})"
                if jit
                else "prng_seed: one key, jax.random.PRNGKey(seed)"
            )
        if latents is not None and tuple(np.shape(latents)) != lead + spec.latent_shape:
            raise ValueError(f"Unexpected latents shape, got {np.shape(latents)}, expected {lead + spec.latent_shape}")


class FlaxStableDiffusionPipeline(_FlaxPipeline):
    """Stable Diffusion 1.x/2.x text-to-image with the API of diffusers' (deleted) Flax pipeline."""

    family = sd.FAMILY.name
    _ids_rank = 1

    def _negative(self, ids: Any, neg_ids: Any) -> Any:
        if neg_ids is not None:
            return neg_ids
        lead = self._lead(ids)  # no negative prompt: the empty prompt's ids, as the old pipeline
        return self.prepare_inputs([""] * int(np.prod(lead))).reshape(*lead, -1)

    def __call__(
        self,
        prompt_ids: jax.Array,
        params: Mapping[str, Any],
        prng_seed: jax.Array,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale: float | jax.Array = 7.5,
        latents: jax.Array | None = None,
        neg_prompt_ids: jax.Array | None = None,
        return_dict: bool = True,
        jit: bool = False,
    ) -> FlaxStableDiffusionPipelineOutput | tuple:
        """images [devices, per_device, H, W, 3] with jit=True (sharded inputs), else [n, H, W, 3]; numpy, 0..1."""
        images = self._run(
            prompt_ids,
            params,
            prng_seed,
            steps=num_inference_steps,
            height=height,
            width=width,
            guidance_scale=guidance_scale,
            latents=latents,
            neg_prompt_ids=neg_prompt_ids,
            jit=jit,
            output_latents=False,
        )
        nsfw = [False] * int(np.prod(images.shape[:-3]))
        if self.safety_checker is not None:  # flagged pictures come back black, as the old pipeline returned them
            from ..models.safety import check

            flat = np.asarray(images).reshape(-1, *images.shape[-3:])
            checker = self.safety_checker
            nsfw = [bool(f) for f in np.asarray(check(checker.graphdef, checker.params, flat).has_nsfw_concepts)]
            flat = np.where(np.array(nsfw)[:, None, None, None], 0.0, flat)
            images = flat.reshape(images.shape)
        return FlaxStableDiffusionPipelineOutput(images, nsfw) if return_dict else (images, nsfw)


class FlaxStableDiffusionXLPipeline(_FlaxPipeline):
    """Stable Diffusion XL text-to-image with the API of diffusers' (deleted) Flax pipeline."""

    family = sdxl.FAMILY.name
    _ids_rank = 2

    def __call__(
        self,
        prompt_ids: jax.Array,
        params: Mapping[str, Any],
        prng_seed: jax.Array,
        num_inference_steps: int = 50,
        guidance_scale: float | jax.Array = 7.5,
        height: int | None = None,
        width: int | None = None,
        latents: jax.Array | None = None,
        neg_prompt_ids: jax.Array | None = None,
        return_dict: bool = True,
        output_type: str | None = None,
        jit: bool = False,
    ) -> FlaxStableDiffusionXLPipelineOutput | tuple:
        """As the SD pipeline; without neg_prompt_ids the unconditional half sees zero embeddings, as before.

        output_type="latent" returns the final latents, NCHW, before the VAE.
        """
        if output_type not in (None, "np", "numpy", "latent"):
            raise ValueError(
                f"output_type={output_type!r}: images come back as numpy; use pipeline.numpy_to_pil(images)"
            )
        images = self._run(
            prompt_ids,
            params,
            prng_seed,
            steps=num_inference_steps,
            height=height,
            width=width,
            guidance_scale=guidance_scale,
            latents=latents,
            neg_prompt_ids=neg_prompt_ids,
            jit=jit,
            output_latents=output_type == "latent",
        )
        return FlaxStableDiffusionXLPipelineOutput(images) if return_dict else (images,)


__all__ = [
    "FlaxDDIMScheduler",
    "FlaxDPMSolverMultistepScheduler",
    "FlaxEulerAncestralDiscreteScheduler",
    "FlaxEulerDiscreteScheduler",
    "FlaxPNDMScheduler",
    "FlaxSchedulerState",
    "FlaxStableDiffusionPipeline",
    "FlaxStableDiffusionPipelineOutput",
    "FlaxStableDiffusionXLPipeline",
    "FlaxStableDiffusionXLPipelineOutput",
]
