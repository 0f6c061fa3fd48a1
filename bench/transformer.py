"""One denoising step of the flow models' transformers on this machine: ours (JAX) against diffusers (PyTorch, CPU),
at their real widths, with the same random weights and the same inputs.

    python bench/transformer.py --model sd35-medium                       # SD 3.5 medium, all 24 blocks, 1024x1024
    python bench/transformer.py --model flux --layers 6                   # FLUX.1 dev at 2 + 4 of its 19 + 38 blocks
    python bench/transformer.py --model z-image --layers 8                # Z-Image-Turbo at 6 + 2 x 1 of its 30 + 2 x 2
    python bench/transformer.py --model klein-4b                          # FLUX.2 [klein] 4B, all 5 + 20 blocks
    python bench/transformer.py --model klein-9b --layers 8               # FLUX.2 [klein] 9B at 2 + 6 of its 8 + 24
    python bench/transformer.py --model sd35-medium --batch 2 --rounds 2  # the guided step: 2 rows per image
    python bench/transformer.py --model flux --layers 1 --size 128 --rounds 1   # a smoke run (any --model)

Models (random weights, the published configs' widths): `sd35-medium` is diffusers' `SD3Transformer2DModel` with
stabilityai/stable-diffusion-3.5-medium's transformer/config.json (24 joint blocks, 13 of them with the second,
image-only attention; 333 text tokens: 77 CLIP + 256 T5); `flux` is `FluxTransformer2DModel` with FLUX.1 dev's
(19 double- and 38 single-stream blocks, the guidance embedding; 512 text tokens); `z-image` is
`ZImageTransformer2DModel` with Tongyi-MAI/Z-Image-Turbo's (30 main blocks, a noise and a context refiner of 2 each,
3840 wide; captions of Qwen3-4B's 2560-wide states), the widths of tests/test_transformer_z_image.py's real-width tests
and tools/model_bytes.py; `klein-4b` and `klein-9b` are `Flux2Transformer2DModel` with FLUX.2 [klein] 4B's (5 double
and 20 single blocks of 24 heads) and 9B's (8 + 24 of 32 heads), tools/model_bytes.py's and
tests/test_transformer_flux2.py's configs, reading 512 text tokens of 3 x the Qwen3 encoder's width (7680; 12288).
`--layers N` cuts the depth so a run fits the machine: for SD 3.5, N joint blocks, the first round(13 N / 24) with
the second attention; for FLUX.1 and FLUX.2, N blocks in all, double-stream in the full model's share (FLUX.1
round(N / 3), Klein round(N / 5) and round(N / 4)) and at least 1 of each kind; for Z-Image, N blocks in all, each
refiner round(N / 17) of them, at least 1, and the main blocks the rest (at least 1). Results give seconds per step
and per block at the depth used (`layers`, `depth`), and a linear estimate at full depth (blocks of unequal cost
counted alike: Z-Image's refiners read the picture's or the caption's tokens alone, so its estimate runs high).

The model is written once (`save_pretrained`, f32, by a process of its own) into `--folder` and read by both sides:
ours loads the transformer alone (`engine.loading.weights.read_safetensors` + `convert`, in `--dtype`) and times one
jitted call (`our_step`) as the family's `denoise` makes it (engine/families/) for the scheduler's t = 500 (sigma
0.5), the text's projection first: SD 3.5 `model(x, t, model.project_context(text), pooled)`, FLUX.1 `..., pooled,
guidance)` with t / 1000, Klein `model(x, t / 1000, model.project_context(text))`, Z-Image `model.velocity(x, t,
model.encode_context(text, lengths), lengths)` (read at (1000 - t) / 1000 and negated inside); the graph static and
the parameters arguments of the program, as engine/sampling/pipeline.py passes them. x is the NHWC latent [batch,
size/8, size/8, 16] (Klein: the VAE's 2x2 patches, [batch, size/16, size/16, 128]). The text is what our pipelines
pass: Klein 512 tokens; Z-Image a caption of `--caption-tokens` real tokens (default 100) padded to the shortest of
128, 256, 512 holding it (`Z_IMAGE.lengths`), its length beside it, the rest masked out but computed. The engine runs the text's projection (Z-Image: the
caption embedder and context refiner) once per request, not per step; it is timed here because diffusers' forward
runs it at every step. Ours compiles (`lower().compile()`, timed on its own) and runs on one XLA CPU device (not the
app's core pair: the transformer alone, not the engine's program), its kernels pinned for oneDNN as the Engine pins
them (`onednn.pin`: bf16 ones where oneDNN serves bf16, the int8 ones of `ours-w8a8`). diffusers gets the same
numbers as its pipelines pass them (NCHW latents; FLUX: latents packed in 2x2 patches and the position ids, as
FluxPipeline makes them; Klein: the cells packed into tokens, 4-axis ids for text and latents and t / 1000 as Flux2KleinPipeline makes them,
the output scattered back by its ids; Z-Image: lists of [C, 1, H, W] latents and of each caption's real tokens, which
it pads to a multiple of 32 itself, at (1000 - t) / 1000, the stacked output negated as ZImagePipeline's loop does),
`torch.inference_mode()`, `torch.set_num_threads(os.cpu_count())`.

`ours-w8a8` (`--systems ours-w8a8,diffusers`; Z-Image and Klein) loads the transformer as `--quantize w8a8` does: the
kernels its family's `Denoiser.w8a8` takes (the blocks' attention and feed-forward) quantized as they are read into
`int8.QuantizedKernel`s and pinned for oneDNN, computed in int8 with activations quantized per call; its output is
compared with diffusers' f32 as an RMS difference relative to diffusers' RMS.

Each system runs in a process of its own, the systems taking turns for `--rounds` rounds; each round loads the
model, makes `--warmup` untimed calls, then keeps the fastest of `--reps` timed calls; each system keeps its fastest
round. Prints a table (seconds per step and per block, load and compile seconds, each process's peak RSS, which
counts the weight files' pages mapped while loading), the ratio ours / diffusers, the largest difference between
their outputs (relative to diffusers' largest value), one JSON line per system, and the 1-minute load average
(repeat above 2).

`--batch` is rows per transformer call: a picture with classifier-free guidance (SD 3.5, the Z-Image and Klein base
models) runs 2 rows per step, so `--batch 2` is its step; FLUX.1 dev embeds the guidance scale and Z-Image-Turbo and
the distilled Klein take none: 1 row per picture.

Memory: every process holds the whole model: the parameter count x 4 bytes in f32 (SD 3.5 medium: 2.47e9 parameters,
about 10 GB per process; FLUX.1: 11.9e9, about 48 GB; Z-Image-Turbo 6.15e9, 24.6 GB; Klein 4B 3.88e9, 15.5 GB; Klein
9B 9.08e9, 36.3 GB; so on a 24 GB machine FLUX.1, Z-Image and Klein 9B need `--layers`). A depth whose
parameters x 4 bytes plus 3 GiB (activations, the runtimes) exceed /proc/meminfo's MemAvailable is refused, naming
the largest depth that fits. (diffusers' SD3 also builds its 384x384 position table in float64 as it loads: a
3.9 GB peak measured at one block, before the weights arrive.) The written models stay in `--folder` for the next
run (`rm -r` it when done).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import best_time  # noqa: E402  bench.py's timer
from tools.published_configs import PUBLISHED  # noqa: E402  the models' configs as their Hub folders hold them

SD35_MEDIUM = dict(  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    qk_norm="rms_norm",
    dual_attention_layers=tuple(range(13)),
)
FLUX1_DEV = dict(  # black-forest-labs/FLUX.1-dev transformer/config.json
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)


def published_transformer(repo: str) -> dict:
    """A published model's transformer config (`tools.published_configs`) as constructor keywords."""
    config = {k: v for k, v in PUBLISHED[repo]["transformer"].items() if not k.startswith("_")}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


Z_IMAGE_TURBO = published_transformer("Tongyi-MAI/Z-Image-Turbo")
KLEIN_4B = published_transformer("black-forest-labs/FLUX.2-klein-4B")
KLEIN_9B = published_transformer("black-forest-labs/FLUX.2-klein-9B")
# Per model: the config; its blocks in all; the text tokens our engine passes (`text_tokens`, at `text_width`); the
# latents' pixels a cell and channels (NHWC); our module and classes and diffusers' class; the config keys naming
# the depth (the written folder's name)
FLUX_LIKE = dict(depth_keys=("num_layers", "num_single_layers"), text_width="joint_attention_dim")
MODELS = {
    "sd35-medium": dict(
        config=SD35_MEDIUM,
        layers=24,
        text_tokens=77 + 256,
        latent=(8, 16),
        ours=("transformer_sd3", "SD3Transformer2DModel", "SD3TransformerConfig"),
        diffusers="SD3Transformer2DModel",
        **FLUX_LIKE,
    ),
    "flux": dict(
        config=FLUX1_DEV,
        layers=19 + 38,
        text_tokens=512,
        latent=(8, 16),
        ours=("transformer_flux", "FluxTransformer2DModel", "FluxTransformerConfig"),
        diffusers="FluxTransformer2DModel",
        **FLUX_LIKE,
    ),
    "z-image": dict(  # ours: a caption padded to the first of these holding it, its length beside it (data)
        config=Z_IMAGE_TURBO,
        layers=30 + 2 * 2,
        text_tokens=(128, 256, 512),
        latent=(8, 16),
        ours=("transformer_z_image", "ZImageTransformer2DModel", "ZImageTransformerConfig"),
        diffusers="ZImageTransformer2DModel",
        depth_keys=("n_layers", "n_refiner_layers"),
        text_width="cap_feat_dim",
    ),
    **{
        name: dict(  # 512 tokens of Qwen3's layers 9, 18 and 27 side by side; the VAE's 2x2 patches a cell
            config=config,
            layers=config["num_layers"] + config["num_single_layers"],
            text_tokens=512,
            latent=(16, 128),
            ours=("transformer_flux2", "Flux2Transformer2DModel", "Flux2TransformerConfig"),
            diffusers="Flux2Transformer2DModel",
            **FLUX_LIKE,
        )
        for name, config in (("klein-4b", KLEIN_4B), ("klein-9b", KLEIN_9B))
    },
}
SYSTEMS = ("ours", "ours-w8a8", "diffusers")
DEFAULT_SYSTEMS = "ours,diffusers"
# the family whose `Denoiser.w8a8` says which kernels ours-w8a8 computes in int8
W8A8_FAMILY = {"z-image": "z-image", "klein-4b": "flux2", "klein-9b": "flux2"}
TIMESTEP = 0.5  # the flow's sigma: the schedulers' t is 1000 x it, which each model reads as its pipeline passes it
GUIDANCE = 3.5  # FLUX.1 dev's embedded guidance scale
CAPTION_TOKENS = 100  # Z-Image's default caption length: a prompt of about 70 words in Qwen3's chat template
HEADROOM = 3 * 2**30  # bytes beside the parameters: activations at 1024x1024, the runtimes
WORKER_ENV = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "HF_HUB_OFFLINE": "1"}


def config_at(model: str, layers: int | None) -> dict:
    """The model's config cut to `layers` blocks (None: all of them)."""
    spec = MODELS[model]
    n = spec["layers"] if layers is None else layers
    if not 1 <= n <= spec["layers"]:
        raise SystemExit(f"--layers {n}: {model} has 1 to {spec['layers']} blocks")
    config = spec["config"]
    if model == "sd35-medium":
        dual = round(len(SD35_MEDIUM["dual_attention_layers"]) * n / spec["layers"])
        return dict(config, num_layers=n, dual_attention_layers=tuple(range(dual)))
    if model == "z-image":  # each refiner keeps its share (2 of 34), at least 1; the main blocks the rest
        refiner = max(1, round(n * config["n_refiner_layers"] / spec["layers"]))
        return dict(config, n_layers=max(1, n - 2 * refiner), n_refiner_layers=refiner)
    double = max(1, round(n * config["num_layers"] / spec["layers"]))
    return dict(config, num_layers=double, num_single_layers=max(1, n - double))


def blocks(config: dict) -> int:
    if "n_refiner_layers" in config:
        return config["n_layers"] + 2 * config["n_refiner_layers"]
    return config["num_layers"] + config.get("num_single_layers", 0)


def depth_words(config: dict) -> str:
    if "n_refiner_layers" in config:
        return f"{config['n_layers']} main + 2 x {config['n_refiner_layers']} refiner blocks"
    if "num_single_layers" in config:
        return f"{config['num_layers']} double + {config['num_single_layers']} single blocks"
    return f"{config['num_layers']} joint blocks ({len(config['dual_attention_layers'])} with attn2)"


def model_dir(folder: Path, model: str, config: dict) -> Path:
    return folder / "-".join([model, *(str(config.get(key, 0)) for key in MODELS[model]["depth_keys"])])


def our_class(model: str):
    import importlib

    module, cls, config_cls = MODELS[model]["ours"]
    module = importlib.import_module(f"engine.models.{module}")
    return getattr(module, cls), getattr(module, config_cls)


def parameter_count(model: str, config: dict) -> int:
    """Counted from our model's shapes (nothing allocated)."""
    from flax import nnx

    from engine.nn.layers import shapes_only

    cls, config_cls = our_class(model)
    with shapes_only():
        _, abstract = nnx.split(cls(config_cls.from_dict(dict(config)), nnx.Rngs(0)))
    return sum(math.prod(var.get_value().shape) for _, var in nnx.to_flat_state(abstract))


def mem_available() -> int:
    """/proc/meminfo's MemAvailable in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("/proc/meminfo has no MemAvailable")


def check_memory(model: str, config: dict) -> int:
    """The parameter count; exits with the largest depth that fits when this one does not."""
    count, available = parameter_count(model, config), mem_available()
    need = 4 * count + HEADROOM
    print(
        f"# memory: {count / 1e9:.2f}e9 parameters x 4 bytes = {4 * count / 1e9:.1f} GB per process "
        f"(+ {HEADROOM / 2**30:.0f} GiB headroom); MemAvailable {available / 1e9:.1f} GB",
        flush=True,
    )
    if need <= available:
        return count
    fits = [
        n
        for n in range(MODELS[model]["layers"], 0, -1)
        if 4 * parameter_count(model, config_at(model, n)) + HEADROOM <= available
    ]
    hint = f"the largest depth that fits now is --layers {fits[0]}" if fits else "no depth fits now"
    raise SystemExit(
        f"{model} at {depth_words(config)}: {count / 1e9:.2f}e9 parameters x 4 bytes = {4 * count / 1e9:.1f} GB "
        f"+ {HEADROOM / 2**30:.0f} GiB headroom > MemAvailable {available / 1e9:.1f} GB (/proc/meminfo): {hint}"
    )


def write_model(model: str, config: dict, folder: Path) -> None:
    """The diffusers transformer at `config`, random weights (seed 0), saved in f32; kept for later runs."""
    target = model_dir(folder, model, config)
    if (target / "config.json").is_file():
        return
    import diffusers
    import torch

    torch.manual_seed(0)
    cls = getattr(diffusers, MODELS[model]["diffusers"])
    start = time.perf_counter()
    transformer = cls(**config).eval()
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=folder))
    transformer.save_pretrained(partial, max_shard_size="2GB")  # small shards: the save's copy stays small
    partial.rename(target)  # whole or absent
    print(f"wrote {target} in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def text_tokens(model: str, caption: int) -> int:
    """The text tokens ours passes: Z-Image's caption padded to the first of its lengths holding it."""
    tokens = MODELS[model]["text_tokens"]
    return next(n for n in tokens if n >= caption) if isinstance(tokens, tuple) else tokens


def inputs(model: str, size: int, batch: int, caption: int) -> dict[str, np.ndarray]:
    """The same numbers for both sides (f32): NHWC latents [batch, size / cell, size / cell, channels], the text
    encoder's states [batch, text_tokens, width] and, for SD 3.5 and FLUX.1, pooled text; for Z-Image each row's
    caption length (`caption` real tokens, the rest padding that is masked out)."""
    spec, rng = MODELS[model], np.random.default_rng(0)
    (cell, channels), config, tokens = spec["latent"], spec["config"], text_tokens(model, caption)
    values = dict(
        x=rng.standard_normal((batch, size // cell, size // cell, channels)).astype(np.float32),
        text=rng.standard_normal((batch, tokens, config[spec["text_width"]])).astype(np.float32),
    )
    if "pooled_projection_dim" in config:
        values["pooled"] = rng.standard_normal((batch, config["pooled_projection_dim"])).astype(np.float32)
    if model == "z-image":
        values["lengths"] = np.full((batch,), caption, np.int32)
    return values


def our_step(model: str, transformer, x, t, text, extra: dict):
    """One step as the family's `denoise` (engine/families/) calls the transformer for the scheduler's t (sigma x
    1000), with the text's part first: its projection (Z-Image: the caption embedder and context refiner), which
    diffusers' forward runs at every step and the engine once per request (`Denoiser.project`)."""
    if model == "z-image":  # z_image.py: the caption refined for its lengths, read at (1000 - t) / 1000, negated
        lengths = extra["lengths"]
        return transformer.velocity(x, t, transformer.encode_context(text, lengths), lengths)
    context = transformer.project_context(text)
    if model == "sd35-medium":
        return transformer(x, t, context, extra["pooled"])
    if model == "flux":
        return transformer(x, t / 1000, context, extra["pooled"], extra["guidance"])
    return transformer(x, t / 1000, context)  # flux2.py: no pooled text, no guidance embedding


def time_ours(
    model: str, folder: Path, values: dict, dtype: str, warmup: int, reps: int, w8a8: bool = False
) -> tuple[dict, np.ndarray]:
    from functools import partial

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from engine.loading.quantize import streaming
    from engine.loading.weights import convert, read_safetensors

    cls, config_cls = our_class(model)
    start = time.perf_counter()
    cfg = config_cls.from_json(folder / "config.json")
    tensors = read_safetensors(sorted(folder.glob("*.safetensors")))
    quantized = None
    if w8a8:  # as `--quantize w8a8` loads it: the family's rule, each kernel quantized as it is read
        from engine.families import FAMILIES

        takes = FAMILIES[W8A8_FAMILY[model]].denoiser.w8a8
        rule = streaming((), ("transformer", takes))
        quantized = lambda path, value: rule(("transformer", *path), value)  # noqa: E731 (paths below the component)
    graphdef, params = convert(
        lambda: cls(cfg, nnx.Rngs(0)), tensors, "bfloat16" if dtype == "bfloat16" else np.float32, quantized=quantized
    )
    del tensors  # the file's mapping: the copies in `params` are what the program reads
    params = jax.device_put(params)
    jax.block_until_ready(params)
    from engine.nn import int8, onednn

    # the kernels oneDNN serves (bf16 on a CPU with native bf16) and the int8 ones reordered once, as the Engine pins
    # them; unpinned, every call reordered each kernel again (Klein's 3072 x 27648 projection: 170 MB a call)
    pinned = onednn.pin(params, int8_values=int8.kernel_values(params))
    load_s = time.perf_counter() - start

    @partial(jax.jit, static_argnums=0)
    def step(graphdef, params, x, t, text, extra):
        return our_step(model, nnx.merge(graphdef, params), x, t, text, extra)

    b = values["x"].shape[0]
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    x, text = (jnp.asarray(values[k], jdtype) for k in ("x", "text"))
    t = jnp.full((b,), TIMESTEP * 1000, jnp.float32)  # the scheduler's timestep
    extra = {k: jnp.asarray(values[k], jdtype) for k in ("pooled",) if k in values}
    extra |= {"lengths": jnp.asarray(values["lengths"])} if "lengths" in values else {}
    extra |= {"guidance": jnp.full((b,), GUIDANCE, jnp.float32)} if model == "flux" else {}
    start = time.perf_counter()
    compiled = step.lower(graphdef, params, x, t, text, extra).compile()
    compile_s = time.perf_counter() - start

    def call():
        return jax.block_until_ready(compiled(params, x, t, text, extra))

    first_s, out = _first_and_best(call, warmup, reps)
    del pinned
    return dict(load_s=load_s, compile_s=compile_s, **first_s), np.asarray(out.astype(jnp.float32))


def time_diffusers(
    model: str, folder: Path, values: dict, dtype: str, warmup: int, reps: int
) -> tuple[dict, np.ndarray]:
    import torch

    torch.set_num_threads(os.cpu_count())
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    start = time.perf_counter()
    import diffusers

    cls = getattr(diffusers, MODELS[model]["diffusers"])
    transformer = cls.from_pretrained(folder, torch_dtype=tdtype).eval()
    load_s = time.perf_counter() - start

    x = torch.from_numpy(np.ascontiguousarray(values["x"].transpose(0, 3, 1, 2))).to(tdtype)  # NCHW
    text = torch.from_numpy(values["text"]).to(tdtype)
    pooled = torch.from_numpy(values["pooled"]).to(tdtype) if "pooled" in values else None
    b, c, h, w = x.shape
    t = torch.full((b,), TIMESTEP * 1000, dtype=torch.float32)  # the scheduler's timestep
    if model == "flux":
        from diffusers import FluxPipeline

        kwargs = dict(  # as FluxPipeline's loop calls it
            hidden_states=FluxPipeline._pack_latents(x, b, c, h, w),
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=(t / 1000).to(tdtype),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", tdtype),
            txt_ids=torch.zeros(text.shape[1], 3, dtype=tdtype),
            guidance=torch.full([1], GUIDANCE, dtype=torch.float32).expand(b),
        )
    elif model == "z-image":
        kwargs = dict(  # as ZImagePipeline's loop calls it: lists of per-picture latents and real caption tokens
            x=list(x.unsqueeze(2).unbind(dim=0)),  # [C, 1, H, W] each
            t=(1000 - t) / 1000,
            cap_feats=[text[i, :n] for i, n in enumerate(values["lengths"])],
        )
    elif model.startswith("klein"):
        from diffusers import Flux2KleinPipeline

        latent_ids = Flux2KleinPipeline._prepare_latent_ids(x)
        kwargs = dict(  # as Flux2KleinPipeline's loop calls it: the latents packed, 4-axis ids, t / 1000
            hidden_states=Flux2KleinPipeline._pack_latents(x),
            timestep=t.to(tdtype) / 1000,
            guidance=None,
            encoder_hidden_states=text,
            txt_ids=Flux2KleinPipeline._prepare_text_ids(text),
            img_ids=latent_ids,
        )
    else:
        kwargs = dict(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t)

    def call():
        with torch.inference_mode():
            return transformer(**kwargs, return_dict=False)[0]

    first_s, out = _first_and_best(call, warmup, reps)
    if model == "flux":  # [b, tokens, 64] -> NCHW, as FluxPipeline unpacks (it takes the picture's size)
        out = FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)
    elif model == "z-image":  # the list stacked, the frame axis dropped, negated into the scheduler's velocity
        out = -torch.stack([o.float() for o in out], dim=0).squeeze(2)
    elif model.startswith("klein"):  # the latent's tokens scattered back to [b, 128, h, w]
        out = Flux2KleinPipeline._unpack_latents_with_ids(out[:, : h * w], latent_ids, h, w)
    return dict(load_s=load_s, compile_s=None, **first_s), out.float().numpy().transpose(0, 2, 3, 1)


def _first_and_best(call, warmup: int, reps: int):
    """The first call's seconds and output, then the fastest of `reps` timed calls after `warmup` untimed ones in
    all (the first call is one of them; with `--warmup 0` it is one of the timed ones)."""
    start = time.perf_counter()
    out = call()
    first_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        call()
    if warmup:
        return dict(first_s=first_s, step_s=best_time(call, reps)), out
    return dict(first_s=first_s, step_s=min([first_s, *([best_time(call, reps - 1)] if reps > 1 else [])])), out


def child(args: argparse.Namespace) -> None:
    config = config_at(args.model, args.layers)
    if args.child == "write":
        write_model(args.model, config, args.folder)
        print(json.dumps({}))
        return
    folder = model_dir(args.folder, args.model, config)
    values = inputs(args.model, args.size, args.batch, args.caption_tokens)
    if args.child == "diffusers":
        result, out = time_diffusers(args.model, folder, values, args.dtype, args.warmup, args.reps)
    else:
        w8a8 = args.child == "ours-w8a8"
        result, out = time_ours(args.model, folder, values, args.dtype, args.warmup, args.reps, w8a8=w8a8)
    np.save(args.folder / f"out-{args.child}.npy", out)
    result["finite"] = bool(np.isfinite(out).all())
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(json.dumps(result), flush=True)


def run_child(system: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", system, "--model", args.model, "--size", str(args.size)]
    command += ["--batch", str(args.batch), "--dtype", args.dtype, "--folder", str(args.folder)]
    command += ["--warmup", str(args.warmup), "--reps", str(args.reps), "--caption-tokens", str(args.caption_tokens)]
    command += ["--layers", str(args.layers)] if args.layers else []
    done = subprocess.run(command, capture_output=True, text=True, env=WORKER_ENV)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="sd35-medium")
    parser.add_argument("--layers", type=int, help="blocks to keep in all (default: all of them)")
    parser.add_argument(
        "--caption-tokens", type=int, default=CAPTION_TOKENS, help="Z-Image: the caption's real tokens (1 to 512)"
    )
    parser.add_argument("--size", type=int, default=1024, help="pixels a side (a multiple of 16)")
    parser.add_argument("--batch", type=int, default=1, help="rows per call (2 for a guided picture)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per round before the timed ones")
    parser.add_argument("--reps", type=int, default=1, help="timed calls per round (the fastest is kept)")
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, of {','.join(SYSTEMS)} (ours-w8a8: Z-Image, Klein)",
    )
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "jax-sd-bench-transformer")
    parser.add_argument("--child", choices=(*SYSTEMS, "write"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        parser.error(f"--systems {args.systems!r}: a comma-separated choice of {', '.join(SYSTEMS)}")
    if "ours-w8a8" in systems and args.model not in W8A8_FAMILY:
        parser.error(f"ours-w8a8 computes Z-Image's and Klein's blocks in int8; {args.model} is not offered w8a8")
    if args.size % 16 or args.size < 16:
        parser.error(f"--size {args.size}: a positive multiple of 16 (8 pixels a latent, 2 latents a token)")
    if not 1 <= args.caption_tokens <= MODELS["z-image"]["text_tokens"][-1]:
        parser.error(f"--caption-tokens {args.caption_tokens}: 1 to {MODELS['z-image']['text_tokens'][-1]}")
    config = config_at(args.model, args.layers)
    count = check_memory(args.model, config)
    args.folder.mkdir(parents=True, exist_ok=True)
    run_child("write", args)  # in a process of its own: its memory is returned before the timed ones start
    rounds: dict[str, list[dict]] = {system: [] for system in systems}
    for _ in range(args.rounds):
        for system in systems:
            rounds[system].append(run_child(system, args))
    load = os.getloadavg()[0]
    spec = MODELS[args.model]
    n, full, side = blocks(config), spec["layers"], args.size // spec["latent"][0]
    text = f"{text_tokens(args.model, args.caption_tokens)} text tokens"
    if args.model == "z-image":  # ours pads a caption to 128, 256 or 512, masked; diffusers to a multiple of 32
        text += f" of which {args.caption_tokens} real, diffusers {-(-args.caption_tokens // 32) * 32}"
    print(
        f"# {args.model}, {depth_words(config)} ({n} of {full}), {args.size}px (latent {side}x{side}x"
        f"{spec['latent'][1]}: {(args.size // 16) ** 2} image + {text}), batch {args.batch}, {args.dtype}, "
        f"best of {args.rounds} round(s); load {load:.2f}"
    )
    print("| system | step s | per block s | full depth s (est.) | compile s | load s | peak RSS GB |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for system, results in rounds.items():
        step = min(r["step_s"] for r in results)
        compiles = [r["compile_s"] for r in results if r["compile_s"] is not None]
        rows[system] = row = dict(
            system=system,
            model=args.model,
            layers=n,
            full_layers=full,
            depth=depth_words(config),
            parameters=count,
            size=args.size,
            batch=args.batch,
            dtype=args.dtype,
            **({"caption_tokens": args.caption_tokens} if args.model == "z-image" else {}),
            step_s=step,
            per_layer_s=step / n,
            full_depth_est_s=step * full / n,
            compile_s=min(compiles) if compiles else None,
            rounds=results,
            load=load,
        )
        compile_s = "-" if row["compile_s"] is None else f"{row['compile_s']:.1f}"
        print(
            f"| {system} | {step:.3f} | {step / n:.4f} | {step * full / n:.2f} | {compile_s} | "
            f"{min(r['load_s'] for r in results):.1f} | {max(r['peak_rss_gb'] for r in results):.1f} |"
        )
    if {"ours", "diffusers"} <= set(systems):
        ours, theirs = (np.load(args.folder / f"out-{s}.npy") for s in ("ours", "diffusers"))
        diff = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        ratio = rows["ours"]["step_s"] / rows["diffusers"]["step_s"]
        print(
            f"ours / diffusers: {ratio:.2f} (step); outputs' largest difference / diffusers' largest value: {diff:.1e}"
        )
        for row in rows.values():
            row.update(ratio=ratio, max_rel_diff=diff)
    if {"ours-w8a8", "diffusers"} <= set(systems):
        quantized, theirs = (np.load(args.folder / f"out-{s}.npy") for s in ("ours-w8a8", "diffusers"))
        rms = float(np.sqrt(np.mean((quantized - theirs) ** 2) / np.mean(theirs**2)))
        ratio = rows["ours-w8a8"]["step_s"] / rows["diffusers"]["step_s"]
        print(f"ours-w8a8 / diffusers: {ratio:.2f} (step); output's RMS difference / diffusers' RMS: {rms:.1e}")
        rows["ours-w8a8"].update(ratio=ratio, rel_rms_diff=rms)
    for row in rows.values():
        print(json.dumps(row))


if __name__ == "__main__":
    main()
