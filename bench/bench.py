"""Our engine against diffusers (PyTorch) on the same model, same machine, same run.

Builds a random-weight Stable Diffusion of the chosen shape with diffusers, saves it in
diffusers layout, and loads that folder in both. Times whole text-to-image calls at two step
counts; the difference gives the cost of one denoising step (UNet with guidance plus
scheduler), the rest is the fixed cost (text encoder, VAE decode, transfer). Prints JSON.

Each system runs in a process of its own, one after the other: in one process, the thread
pools that JAX and PyTorch leave spinning after their work slow the other one down (on a
2-core CPU, diffusers' step took 6.5x as long next to JAX as alone).

    python bench/bench.py --config small               # CPU: a small SD-shaped model
    python bench/bench.py --config sd15 --images 1 8   # GPU: SD1.5 at 512x512, bf16 vs fp16
    python bench/bench.py --config sd15 --compile      # also diffusers with torch.compile
    python bench/bench.py --config sdxl --images 1 4   # GPU: SDXL at 1024x1024 (sdxl-small on a CPU)
    python bench/bench.py --config sd2-quarter --rounds 3  # a shared CPU: each system's best of 3 turns
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    # SD-shaped, small enough for a 2-core CPU: three levels, cross-attention, 32x32 latents.
    "small": dict(
        unet=dict(
            block_out_channels=(64, 128, 128),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=256,
            attention_head_dim=4,
            layers_per_block=1,
            sample_size=32,
        ),
        vae=dict(block_out_channels=(32, 64, 64, 64), layers_per_block=1),
        clip=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
        size=256,
    ),
    # SD 1.5's layout at a quarter of its width (8 heads of 8 to 32), 256x256: attention over 1024
    # tokens with many narrow heads, where the CPU's cost is the logits' memory traffic.
    "sd15-quarter": dict(
        unet=dict(
            block_out_channels=(64, 128, 256, 256),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
            layers_per_block=2,
            sample_size=32,
        ),
        vae=dict(block_out_channels=(32, 64, 128, 128), layers_per_block=2),
        clip=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12),
        size=256,
    ),
    # SD 2.x's layout (linear projections, 64-wide heads, 1024-wide text) at a quarter of its width, 256x256.
    "sd2-quarter": dict(
        unet=dict(
            block_out_channels=(64, 128, 256, 256),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=1024,
            attention_head_dim=(1, 2, 4, 4),  # heads per block (diffusers' misnomer): 64 wide each
            use_linear_projection=True,
            layers_per_block=2,
            sample_size=32,
        ),
        vae=dict(block_out_channels=(32, 64, 128, 128), layers_per_block=2),
        clip=dict(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16, hidden_act="gelu"
        ),
        size=256,
    ),
    # Stable Diffusion 1.5 at 256x256: the real model's every width, a quarter of its pixels.
    "sd15-256": dict(
        unet=dict(
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
            layers_per_block=2,
            sample_size=64,
        ),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2),
        clip=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        size=256,
    ),
    # Stable Diffusion 1.5 at 512x512.
    "sd15": dict(
        unet=dict(
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
            layers_per_block=2,
            sample_size=64,
        ),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2),
        clip=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        size=512,
    ),
    # SDXL-shaped, small enough for a 2-core CPU: two encoders, text_time conditioning, deep transformer blocks.
    "sdxl-small": dict(
        family="sdxl",
        unet=dict(
            block_out_channels=(64, 128),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=32,
            projection_class_embeddings_input_dim=256 + 6 * 32,
            cross_attention_dim=128 + 256,
            layers_per_block=1,
            sample_size=32,
        ),
        vae=dict(block_out_channels=(32, 64, 64, 64), layers_per_block=1),
        clip=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4),
        clip_2=dict(
            hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4, projection_dim=256
        ),
        size=256,
    ),
    # Stable Diffusion XL base 1.0 at 1024x1024.
    "sdxl": dict(
        family="sdxl",
        unet=dict(
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
            cross_attention_dim=2048,
            layers_per_block=2,
            sample_size=128,
        ),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, scaling_factor=0.13025),
        clip=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        clip_2=dict(
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=20,
            projection_dim=1280,
            hidden_act="gelu",
        ),
        size=1024,
    ),
}
# The guidance scale each family is used with (its model cards); the scheduler is the folder's own.
GUIDANCE = {"sd": 7.5, "sdxl": 5.0}


def write_model(config: dict, folder: Path, half: bool) -> None:
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        PNDMScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    torch.manual_seed(0)
    tokenizer = CLIPTokenizer.from_pretrained(str(ROOT / "engine" / "assets" / "default" / "tokenizer"))

    def clip(settings: dict) -> CLIPTextConfig:
        ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
        return CLIPTextConfig(max_position_embeddings=77, **ids, **settings)

    vae_blocks = len(config["vae"]["block_out_channels"])
    parts = dict(
        unet=UNet2DConditionModel(**config["unet"]),
        vae=AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * vae_blocks,
            up_block_types=("UpDecoderBlock2D",) * vae_blocks,
            **config["vae"],
        ),
        text_encoder=CLIPTextModel(clip(config["clip"])),
        tokenizer=tokenizer,
    )
    schedule = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1)
    if config.get("family", "sd") == "sdxl":
        pipe = StableDiffusionXLPipeline(
            **parts,
            text_encoder_2=CLIPTextModelWithProjection(clip(config["clip_2"])),
            tokenizer_2=tokenizer,
            scheduler=EulerDiscreteScheduler(**schedule, timestep_spacing="leading"),
            add_watermarker=False,
        )
    else:
        pipe = StableDiffusionPipeline(
            **parts,
            scheduler=PNDMScheduler(**schedule, skip_prk_steps=True),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    if half:
        pipe = pipe.to(torch.float16)
    pipe.save_pretrained(folder, variant="fp16" if half else None)


def best_time(fn, reps: int) -> float:
    # The fastest of `reps` runs: what the code costs when nothing else wants the machine.
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def per_step(call, steps: tuple[int, int], reps: int) -> dict:
    lo, hi = (best_time(lambda n=n: call(n), reps) for n in steps)
    step = (hi - lo) / (steps[1] - steps[0])
    return {"step_ms": 1000 * step, "fixed_ms": 1000 * (lo - steps[0] * step), f"call_{steps[1]}_steps_s": hi}


def bench_ours(
    folder: Path, images: int, size: int, guidance: float, steps: tuple[int, int], reps: int, chunk_steps: int = 1
) -> dict:
    from engine import keep_freed_memory, load_pipeline
    from engine.sampling.pairs import pair_cores

    pair_cores()  # as the app and the command line run on a CPU host
    keep_freed_memory()
    pipe = load_pipeline(folder, chunk_steps=chunk_steps)
    start = time.perf_counter()
    pipe.generate("warm up", num_images=images, height=size, width=size, num_inference_steps=1)
    compile_s = time.perf_counter() - start

    def call(n):
        return pipe.generate(
            "a photo of a cat",
            num_images=images,
            height=size,
            width=size,
            num_inference_steps=n,
            guidance_scale=guidance,
        )

    result = per_step(call, steps, reps)
    return {**result, "compile_s": compile_s, "devices": pipe.devices}


def bench_diffusers(
    folder: Path, images: int, size: int, guidance: float, steps: tuple[int, int], reps: int, half: bool, compile_: bool
) -> dict:
    import torch
    from diffusers import DiffusionPipeline

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the same cores JAX's CPU backend uses
    dtype = torch.float16 if half else torch.float32
    pipe = DiffusionPipeline.from_pretrained(folder, variant="fp16" if half else None, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    if compile_:
        pipe.unet = torch.compile(pipe.unet)
        pipe.vae.decode = torch.compile(pipe.vae.decode)

    def call(n):
        with torch.inference_mode():
            pipe(
                "a photo of a cat",
                num_images_per_prompt=images,
                height=size,
                width=size,
                num_inference_steps=n,
                guidance_scale=guidance,
                output_type="np",
            )

    start = time.perf_counter()
    call(2)
    warm_s = time.perf_counter() - start
    return {**per_step(call, steps, reps), "warm_s": warm_s, "device": device, "threads": torch.get_num_threads()}


def bench_diffusers_flax(
    folder: Path, images: int, size: int, guidance: float, steps: tuple[int, int], reps: int, half: bool
) -> dict:
    """diffusers' last Flax UNet (0.35, installed apart with --flax-diffusers) in the old pipeline's jitted loop.

    What `FlaxStableDiffusionPipeline._generate` ran per step: both guidance halves in one UNet call, the
    guidance arithmetic and the Flax scheduler's step, in a `fori_loop` over a static step count. transformers 5
    has no Flax CLIP, so the text embeddings are random and the fixed cost holds no text encoder or VAE: only
    `step_ms` compares. The UNet's weights are the folder's, converted as diffusers' `from_pt` converted them.
    """
    import jax
    import jax.numpy as jnp
    import torch  # only to read the folder's weights for the conversion
    from diffusers import FlaxPNDMScheduler, FlaxUNet2DConditionModel
    from diffusers.models.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax
    from safetensors.torch import load_file

    dtype = jnp.bfloat16 if half else jnp.float32  # as the old pipelines ran on accelerators
    unet = FlaxUNet2DConditionModel.from_config(
        FlaxUNet2DConditionModel.load_config(folder, subfolder="unet"), dtype=dtype
    )
    weights = folder / "unet" / f"diffusion_pytorch_model{'.fp16' if half else ''}.safetensors"
    state = {k: v.float() for k, v in load_file(weights).items()}
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), convert_pytorch_state_dict_to_flax(state, unet))
    del torch, state
    scheduler, scheduler_params = FlaxPNDMScheduler.from_pretrained(folder, subfolder="scheduler")
    latent = size // 8
    shape = (images, unet.config.in_channels, latent, latent)
    context = jax.random.normal(jax.random.PRNGKey(1), (2 * images, 77, unet.config.cross_attention_dim))

    def generate(params, latents, num_steps: int):
        state = scheduler.set_timesteps(scheduler_params, num_inference_steps=num_steps, shape=latents.shape)

        def body(step, args):
            latents, state = args
            t = jnp.array(state.timesteps, dtype=jnp.int32)[step]
            model_in = scheduler.scale_model_input(state, jnp.concatenate([latents] * 2), t)
            timestep = jnp.broadcast_to(t, model_in.shape[0])
            noise = unet.apply({"params": params}, model_in, timestep, encoder_hidden_states=context).sample
            uncond, cond = jnp.split(noise, 2, axis=0)
            noise = uncond + guidance * (cond - uncond)
            return scheduler.step(state, noise, t, latents).to_tuple()

        return jax.lax.fori_loop(0, num_steps, body, (latents * scheduler_params.init_noise_sigma, state))[0]

    run = jax.jit(generate, static_argnums=2)
    latents = jax.random.normal(jax.random.PRNGKey(0), shape)
    start = time.perf_counter()
    for n in steps:
        run(params, latents, n).block_until_ready()
    compile_s = time.perf_counter() - start
    result = per_step(lambda n: run(params, latents, n).block_until_ready(), steps, reps)
    return {**result, "compile_s": compile_s, "diffusers": __import__("diffusers").__version__}


WORKER_ENV = dict(os.environ)  # as this process was started, before main() changes it
FLAX_DIFFUSERS: Path | None = None  # --flax-diffusers


def run_worker(
    system: str, folder: Path, case: tuple, accelerator: bool, cores: int | None = None, chunk_steps: int = 1
) -> dict:
    """One system's timings, measured in a fresh Python process (on the first `cores` CPUs, if given)."""
    images, size, guidance, steps, reps = case
    pin = ["taskset", "-c", f"0-{cores - 1}"] if cores else []
    command = [*pin, sys.executable, __file__, "--worker", system, "--folder", str(folder), "--images", str(images)]
    command += ["--size", str(size), "--guidance", str(guidance), "--steps", *map(str, steps), "--reps", str(reps)]
    command += ["--half"] if accelerator else []
    command += ["--chunk-steps", str(chunk_steps)] if system == "ours" else []
    env = dict(WORKER_ENV)
    if system == "diffusers_flax":  # diffusers 0.35 from its own folder, ahead of the installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FLAX_DIFFUSERS), env.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker(args: argparse.Namespace) -> None:
    case = (args.images[0], args.size, args.guidance, tuple(args.steps), args.reps)
    if args.worker == "ours":
        result = bench_ours(args.folder, *case, args.chunk_steps)
    elif args.worker == "diffusers_flax":
        result = bench_diffusers_flax(args.folder, *case, args.half)
    else:
        result = bench_diffusers(args.folder, *case, args.half, args.worker == "diffusers_compile")
    print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--images", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--steps", type=int, nargs=2, default=[4, 12], help="two step counts; the slope is the step cost"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, taking turns; each keeps its fastest round (a shared "
        "machine's slow minutes then hit one round of one system, not the ratio)",
    )
    parser.add_argument("--compile", action="store_true", help="also time diffusers with torch.compile")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument(
        "--flax-diffusers",
        type=Path,
        help="a folder holding diffusers 0.35 (pip install --no-deps --target DIR diffusers==0.35.2): also time its "
        "Flax UNet in the old Flax pipeline's jitted loop (SD configs only)",
    )
    parser.add_argument(
        "--cores",
        type=int,
        help="pin each system to this many CPUs (both thread pools follow): on a shared machine, one core "
        "each keeps PyTorch's spinning thread barriers out of the comparison",
    )
    parser.add_argument(
        "--chunk-steps",
        type=int,
        default=1,
        help="ours: steps a dispatch (the Engine's chunk_steps; the app runs 1): on a fast GPU a step may be "
        "short enough for the host's round trip between chunks to show",
    )
    # A child process's part: one system, one case (see run_worker).
    parser.add_argument(
        "--worker", choices=["ours", "diffusers", "diffusers_compile", "diffusers_flax"], help=argparse.SUPPRESS
    )
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--guidance", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--half", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    # This process only looks at the device; JAX would otherwise reserve most of the GPU's
    # memory here, for as long as the workers that need it run.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    config = CONFIGS[args.config]
    accelerator = jax.default_backend() != "cpu"
    report = {
        "config": args.config,
        "size": config["size"],
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "steps": args.steps,
        "runs": [],
    }
    systems = ["ours"] + (
        [] if args.skip_reference else ["diffusers"] + (["diffusers_compile"] if args.compile else [])
    )
    if args.flax_diffusers:
        global FLAX_DIFFUSERS
        FLAX_DIFFUSERS = args.flax_diffusers.resolve()
        systems.append("diffusers_flax")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        write_model(config, folder, half=accelerator)
        guidance = GUIDANCE[config.get("family", "sd")]
        for images in args.images:
            case = (images, config["size"], guidance, tuple(args.steps), args.reps)
            load = os.getloadavg()[0]  # the machine is shared: the 1-minute load average around the run
            rounds = [
                {
                    system: run_worker(system, folder, case, accelerator, args.cores, args.chunk_steps)
                    for system in systems
                }
                for _ in range(args.rounds)
            ]
            run = {"images": images, "cores": args.cores or os.cpu_count(), "load": [load, os.getloadavg()[0]]}
            for system in systems:
                best = min((r[system] for r in rounds), key=lambda result: result["step_ms"])
                run[system] = {**best, "step_ms_rounds": [r[system]["step_ms"] for r in rounds]}
            for system in systems[1:]:
                run[f"speedup_step_vs_{system}"] = run[system]["step_ms"] / run["ours"]["step_ms"]
                if system == "diffusers_flax":
                    continue  # its calls hold no text encoder or VAE
                run[f"speedup_call_vs_{system}"] = (
                    run[system][f"call_{args.steps[1]}_steps_s"] / run["ours"][f"call_{args.steps[1]}_steps_s"]
                )
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
