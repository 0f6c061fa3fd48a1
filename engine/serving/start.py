"""Starting an engine: the run dtype, the on-disk compilation cache, and `load_pipeline`, which loads a model
with its VAE, ControlNet, LoRAs and safety checker and puts it on the devices."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

from ..errors import ConfigError
from ..families import FAMILIES
from ..families.loader import load_model_folder
from ..loading.controlnet import attach_controlnet, load_controlnet
from ..loading.lora import load_lora, lora_factors
from ..loading.models_folder import ModelsFolder
from ..loading.quantize import MODES as QUANTIZE_MODES
from ..loading.quantize import quantize_tiny_decoder
from ..loading.textual_inversion import attach_embeddings, encoder_parts
from ..loading.upscaler_folder import UpscalerFolder
from ..loading.vae import attach_vae, load_vae
from ..nn import onednn
from .engine import Engine
from .model_pool import DEFAULT_MAX_LOADED, ModelPool


def enable_compile_cache(path: str | os.PathLike | None = None) -> Path:
    """Keeps compiled programs on disk (JAX_SD_CACHE_DIR, default ~/.cache/jax-sd/xla)."""
    path = Path(path or os.environ.get("JAX_SD_CACHE_DIR") or Path.home() / ".cache" / "jax-sd" / "xla")
    path.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir not in (None, str(path)):
        # JAX opens its cache once, at the first compile after a folder is named: moving it takes a reset.
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


KEEP_MEMORY_SWITCH = "JAX_SD_KEEP_FREED_MEMORY"  # "0": leave glibc's malloc as it is


def keep_freed_memory() -> bool:
    """Has glibc's malloc keep the memory a CPU program frees, for the next call to reuse. Call before JAX starts its
    backends; returns whether it took effect.

    XLA's CPU programs allocate their temporaries as one block at every call (96 MB for TAESD's 512x512 decode,
    53 MB for SD-Turbo's UNet step). glibc maps a block that large afresh each time and returns it on free, so the
    kernel zeroes every page again at first touch: 24,577 page faults a decode, and decodes that took 0.18 or
    0.29 s by turns. With one arena (every thread's), no mapped blocks and no trimming below 2 GB, the block is
    reused: the decode takes 0.148 s, every time (2 Zen 4 cores). The process's resident size measured the same
    (5.6 GB for SD-Turbo in bf16). Only where JAX runs on the CPU (no accelerator plugin installed, or
    JAX_PLATFORMS=cpu), on glibc, and not with JAX_SD_KEEP_FREED_MEMORY=0."""
    import ctypes
    import importlib.util

    from ..sampling.pairs import backends_started

    if os.environ.get(KEEP_MEMORY_SWITCH) == "0" or backends_started():
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "")
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    if platforms.split(",")[0] not in ("", "cpu") or (not platforms and any(map(importlib.util.find_spec, plugins))):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # glibc's malloc.h
    return bool(mallopt(m_arena_max, 1) and mallopt(m_mmap_max, 0) and mallopt(m_trim_threshold, 2**31 - 1))


DTYPES = ("float32", "bfloat16", "float16")


def default_dtype() -> str:
    """JAX_SD_DTYPE when set; else bf16 on accelerators and, on a CPU, `onednn.cpu_dtype()`'s choice: bf16 where
    the CPU has native bf16 and the oneDNN kernels are built, f32 elsewhere."""
    chosen = os.environ.get("JAX_SD_DTYPE")
    if chosen:
        if chosen not in DTYPES:
            raise ConfigError(f"JAX_SD_DTYPE={chosen!r} is not one of {', '.join(DTYPES)} (or unset: the host's best)")
        return chosen
    return onednn.cpu_dtype() if jax.default_backend() == "cpu" else "bfloat16"


def load_pipeline(
    source: str | os.PathLike | None = None,
    dtype: str | None = None,
    images_per_device: int = 1,
    devices: list[jax.Device] | None = None,
    safety_checker: bool = True,
    controlnet: str | os.PathLike | None = None,
    loras: dict[str, str | os.PathLike] | None = None,
    vae: str | os.PathLike | None = None,
    t5: str = "device",
    quantize: str | None = None,
    config: str | os.PathLike | None = None,
    prediction_type: str | None = None,
    embeddings: str | os.PathLike | None = None,
    upscalers: str | os.PathLike | UpscalerFolder | None = None,
    embeddings_where_taken: bool = False,
    **serving,
) -> Engine:
    """Loads a model: None (the embedded default), a diffusers-format folder or Hub id, or a single-file checkpoint
    in the original layout (`FILE.safetensors`, or `.ckpt` read without running its pickle: SD 1.x, 2.x, SDXL and
    their inpainting UNets). A single file's configs, tokenizers and scheduler come from `config` (a diffusers folder
    or Hub id of the same kind, as diffusers' `from_single_file(config=)`), else from the Hub repo diffusers uses for
    its kind; `prediction_type` ("epsilon" or "v_prediction") overrides that scheduler's, as does a `.yaml` beside
    the file that says `parameterization: "v"` (SD 2.x 768-v files).

    `safety_checker`: run the folder's own safety checker on every picture, when it ships one (SD 1.x
    repositories do); False turns it off, for local use. `serving`: the Engine's options (max_batch_size,
    sizes, chunk_steps, max_waiting, max_plans, max_live_plans, previews, preview_every_s). `controlnet`: a
    diffusers-format ControlNet folder or Hub id, run beside the UNet for requests with a control image. `loras`:
    name -> LoRA file, folder or Hub id (diffusers/PEFT or kohya layout), each refused at load if it does not fit.
    `quantize`: "int8" keeps the denoiser's large linear kernels as int8 with one scale per output channel
    (engine/loading/quantize.py: about half their bf16 memory), and a Qwen3 text encoder's, on the devices or the
    host; "w8a8" computes the denoiser's linear layers and convolutions in int8 (engine/nn/int8.py: on an AVX2 CPU
    about twice f32's speed; the UNet families, Z-Image and FLUX.2 [klein]), and a TAESD decoder's inner
    convolutions, with a Qwen3 text encoder as int8 weights; or None; not with LoRAs, which merge into
    kernels.
    `vae`: a diffusers-format VAE folder (or a pipeline folder's `vae/`) or Hub id that draws in place of the
    model's own: an `AutoencoderKL` (stabilityai/sd-vae-ft-mse) or an `AutoencoderTiny` (madebyollin/taesd for
    SD 1.x/2.x, taesdxl for SDXL: decodes in a fraction of the time, and previews become decoded pictures), also in
    madebyollin/taesd's own files (`taesd_decoder.safetensors`, `taef2_encoder.pth`: one file, or a folder or Hub
    id holding them; a decoder alone refuses the requests that read a picture); refused at load if its latents are
    not the UNet's. `t5`: where SD3's and FLUX.1's T5 encoder runs: "device" with
    the other networks, "host" (its 9.5 GB of bf16 weights kept in host memory, run on the CPU once per request), or
    "off" (SD3 only: zeros in its place, as diffusers runs a folder without it). `embeddings`: a folder of textual
    inversion embeddings (A1111's `embeddings/`: `.pt`, `.bin`, `.safetensors`) or one file, each called in prompts by
    its file's name; in a folder, one that does not fit the model is skipped and `Engine.embeddings.skipped` says why.
    `upscalers`: a folder of upscaler networks (ESRGAN, Real-ESRGAN, SRVGGNetCompact files), offered beside Lanczos and
    Nearest to hires fix and `Engine.upscale`; each file's layout is told at start and its weights load at first use
    (or an `UpscalerFolder` several engines share). `embeddings_where_taken`: a model whose family takes no
    embeddings loads without them instead of being refused (a models folder's `embeddings/` serves every model).
    """
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise ConfigError(f"quantize={quantize!r} is not one of {', '.join(QUANTIZE_MODES)} (or None: no quantization)")
    if quantize is not None and loras:
        raise ConfigError(
            f"quantize={quantize!r} and LoRAs do not go together: a LoRA merges into the float kernels that "
            "quantizing replaces; start without one or the other"
        )
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)} (or None: the host's best)")
    model = load_model_folder(
        source,
        dtype,
        t5=t5,
        config=config,
        prediction_type=prediction_type,
        safety_checker=safety_checker,
        quantize=quantize,
    )
    adapters = FAMILIES[model.family].denoiser.adapters
    for what, label, given in (("controlnet", "ControlNet", controlnet), ("lora", "LoRA", loras)):
        if given and what not in adapters:
            raise ConfigError(f"{model.label} models take no {label} yet: start without one")
    if vae is not None:
        references = FAMILIES[model.family].denoiser.references
        edits_only = references is not None and references.min_count > 0
        model = attach_vae(model, load_vae(vae, dtype), reads_pictures=bool(model.variant.needs) or edits_only)
    if controlnet is not None:
        model = attach_controlnet(model, load_controlnet(controlnet, dtype))
    if embeddings is not None and not (embeddings_where_taken and not encoder_parts(FAMILIES[model.family])):
        # rows appended to the text encoders' token tables, once
        model = attach_embeddings(model, embeddings, FAMILIES[model.family])
    factors = {name: lora_factors(load_lora(path), model.params) for name, path in (loras or {}).items()}
    # The denoiser's kernels were quantized as load_model_folder read them; a TAESD's decode computes in int8 with
    # w8a8's UNet (most of a picture's fixed part on a CPU that computes in int8), attached after the load
    if quantize == "w8a8":
        model = dataclasses.replace(model, params=quantize_tiny_decoder(model.params))
    checker = None
    if safety_checker:
        from ..loading.safety import load_safety_checker

        checker = load_safety_checker(model.config_folder or source, dtype)
    folder = upscalers
    if upscalers is not None and not isinstance(upscalers, UpscalerFolder):
        folder = UpscalerFolder.for_models(upscalers=upscalers)
    engine = Engine(
        model,
        devices=devices,
        images_per_device=images_per_device,
        safety=checker,
        loras=factors,
        upscalers=folder,
        **serving,
    )
    if not safety_checker:
        engine.safety_mode = "off"
    return engine


def load_models(
    models: str | os.PathLike,
    default: str | None = None,
    max_loaded: int = DEFAULT_MAX_LOADED,
    embeddings: str | os.PathLike | None = None,
    upscalers: str | os.PathLike | None = None,
    config: str | os.PathLike | None = None,
    prediction_type: str | None = None,
    **options,
) -> ModelPool:
    """Serves a models folder in AUTOMATIC1111's layout (`loading/models_folder.py`): every checkpoint of its
    `Stable-diffusion/` (single files and diffusers folders alike), loaded on demand, at most `max_loaded` at once
    (serving/model_pool.py); the LoRAs of its `Lora/`, called from prompts; its `embeddings/` (or `embeddings`) and
    its `ESRGAN/` and `RealESRGAN/` upscalers (or `upscalers`) for every model. `default`: the model a request
    without one draws with (a title, name or hash; default: the first in the folder). `config` and
    `prediction_type` are the single files' (`load_pipeline`'s); `options`: every other `load_pipeline` option,
    the same for each model. Nothing is loaded yet: `ModelPool.load` or `start_warmup` loads the default."""
    folder = ModelsFolder.open(models)
    shared = UpscalerFolder.for_models(models=models, upscalers=upscalers)
    embeddings = embeddings if embeddings is not None else folder.embeddings

    def load(checkpoint) -> Engine:
        single = checkpoint.path.is_file()
        return load_pipeline(
            checkpoint.path,
            embeddings=embeddings,
            embeddings_where_taken=True,
            upscalers=shared,
            config=config if single else None,
            prediction_type=prediction_type if single else None,
            **options,
        )

    return ModelPool(folder, load, default, max_loaded, upscalers=shared)
