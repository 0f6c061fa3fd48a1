"""Seconds per picture on this machine, as a visitor waits for one: ours against diffusers (PyTorch, f32 and bf16)
with the same VAE, on random-weight models of the shapes a CPU user picks.

    python bench/picture.py --model sd-turbo --steps 1 4 --rounds 3   # SD-Turbo's shape at 512x512, no guidance
    python bench/picture.py --model sdxs --steps 1                    # an SDXS-512-like small UNet, tiny VAE
    python bench/picture.py --model sd15-lcm --steps 4                # SD 1.5's shape with the LCM sampler

Each model is written once with diffusers (`save_pretrained`): the pipeline folder and a TAESD-shaped
`AutoencoderTiny` folder beside it. Each system runs in a process of its own, the systems taking turns for
`--rounds` rounds; each keeps its fastest picture (after a warm-up call) per step count. Systems:
`ours-bf16` (bf16 through oneDNN, engine/nn/onednn.py: the app's default on a CPU with native bf16), `ours-w8a8`
(`--quantize w8a8`: the UNet's products in oneDNN's int8, engine/nn/int8.py), `ours`
(f32, the app's core pair) with the model's own KL VAE and with the tiny one (`vae=`), `diffusers`
f32 and `diffusers-bf16` with the tiny VAE (`pipe.vae = AutoencoderTiny`), `diffusers-kl` f32 with the KL VAE, and
`openvino-taesd` (asked for by name, after `pip install --no-deps -r bench/requirements-openvino.txt`): FastSD CPU's
recipe, the text encoder, UNet and tiny decoder converted to OpenVINO (`time_openvino`). optimum-intel, FastSD CPU's
loader, is not used: it requires torchvision, which breaks against the pinned CPU torch.
Prints one JSON line per system and the table; the 1-minute load average rides along (repeat above 2).

`--isa avx2|avx512_core|avx512_core_bf16` caps the instructions every system may use, each in its own process
(`isa_environment`), so that one machine measures the CPU classes below its own: ONEDNN_MAX_CPU_ISA for oneDNN
(ours; PyTorch's and OpenVINO's bundled copies read it too; OV_CPU_MAX_ISA, its plugin's own kernels' cap, is set
alike and is honoured by OpenVINO builds with it), `--xla_cpu_max_isa` in XLA_FLAGS for the code XLA generates, and
ATEN_CPU_CAPABILITY for PyTorch's own vector kernels. `native` (the default) sets none and clears any inherited.
The table's header names the CPU, its vector flags and the cap. `--dry-run` prints the header and each system's
environment, and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import CONFIGS, best_time  # noqa: E402  the shapes bench.py writes, its timer

SD2_UNET = dict(  # stabilityai/sd-turbo's unet/config.json (SD 2.1-base)
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=1024,
    attention_head_dim=(5, 10, 20, 20),
    use_linear_projection=True,
    layers_per_block=2,
    sample_size=64,
)
OPENCLIP_H = dict(  # its text_encoder/config.json (OpenCLIP ViT-H/14's text tower)
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16, hidden_act="gelu"
)
SD15 = CONFIGS["sd15"]  # SD 1.5's UNet, CLIP-L and KL VAE, as bench.py writes them
SD15_UNET, CLIP_L, KL_VAE = SD15["unet"], SD15["clip"], SD15["vae"]
MODELS = {
    # Trailing timesteps and no guidance, as SD-Turbo's folder ships (our loader reads it as Turbo).
    "sd-turbo": dict(unet=SD2_UNET, clip=OPENCLIP_H, vae=KL_VAE, scheduler="euler", guidance=0.0, size=512),
    # SDXS-512: SD 2.1's text side, a UNet with fewer levels, one layer per block, no middle block.
    "sdxs": dict(
        unet=dict(
            SD2_UNET,
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(5, 10, 20),
            layers_per_block=1,
            mid_block_type=None,
        ),
        clip=OPENCLIP_H,
        vae=KL_VAE,
        scheduler="euler",
        guidance=0.0,
        size=512,
    ),
    "sd15-lcm": dict(unet=SD15_UNET, clip=CLIP_L, vae=KL_VAE, scheduler="lcm", guidance=1.0, size=512),
}
WORKER_ENV = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "HF_HUB_OFFLINE": "1"}
ISAS = {  # --isa -> its name for oneDNN (and OpenVINO), for XLA's --xla_cpu_max_isa, and for PyTorch's ATen
    "avx2": ("AVX2", "AVX2", "avx2"),
    "avx512_core": ("AVX512_CORE", "AVX512", "avx512"),
    "avx512_core_bf16": ("AVX512_CORE_BF16", "AVX512_BF16", "avx512"),  # ATen's widest; its bf16 is oneDNN's
    "native": None,
}
CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "OV_CPU_MAX_ISA", "ATEN_CPU_CAPABILITY")
XLA_CAP = "--xla_cpu_max_isa"
VECTOR_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def isa_environment(isa: str, base: dict[str, str]) -> dict[str, str]:
    """The environment a system's process runs under with the instruction set capped to `isa` (a key of ISAS):
    `base` with every cap this script knows set to it, or removed for `native`; XLA_FLAGS keeps its other flags."""
    env = {name: value for name, value in base.items() if name not in CAP_VARIABLES}
    flags = [flag for flag in env.pop("XLA_FLAGS", "").split() if flag.split("=")[0] != XLA_CAP]
    if ISAS[isa] is not None:
        onednn, xla, aten = ISAS[isa]
        env.update(ONEDNN_MAX_CPU_ISA=onednn, OV_CPU_MAX_ISA=onednn, ATEN_CPU_CAPABILITY=aten)
        flags.append(f"{XLA_CAP}={xla}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def cpu_header(isa: str) -> str:
    """One line for the table's header: this machine's CPU model, its vector flags, the cores this process may use
    and the cap the systems ran under."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    vector = " ".join(flag for flag in VECTOR_FLAGS if flag in flags) or "none of " + " ".join(VECTOR_FLAGS)
    cap = "none (native)" if ISAS[isa] is None else f"{isa} ({', '.join(_cap_settings(isa))})"
    return f"# {model}, {len(os.sched_getaffinity(0))} cores; flags: {vector}; instruction set cap: {cap}"


def _cap_settings(isa: str) -> list[str]:
    env = isa_environment(isa, {})
    return [f"{name}={env[name]}" for name in (*CAP_VARIABLES, "XLA_FLAGS") if name in env]


def write_models(name: str, folder: Path) -> tuple[Path, Path]:
    """The model's pipeline folder and its TAESD-shaped tiny VAE's under `folder`, written once (random weights)."""
    spec = MODELS[name]
    pipe_dir, tiny_dir = folder / name, folder / f"{name}-taesd"
    if (pipe_dir / "model_index.json").is_file() and (tiny_dir / "config.json").is_file():
        return pipe_dir, tiny_dir  # written already: no PyTorch imported (bench/cold_start.py times beside it)
    import torch
    from diffusers import (
        AutoencoderKL,
        AutoencoderTiny,
        EulerDiscreteScheduler,
        LCMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    tokenizer = CLIPTokenizer.from_pretrained(str(ROOT / "engine" / "assets" / "default" / "tokenizer"))
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    blocks = len(spec["vae"]["block_out_channels"])
    schedule = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1)
    if spec["scheduler"] == "lcm":
        scheduler = LCMScheduler(**schedule)
    else:
        scheduler = EulerDiscreteScheduler(**schedule, timestep_spacing="trailing")
    pipe = StableDiffusionPipeline(
        unet=UNet2DConditionModel(**spec["unet"]),
        vae=AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * blocks,
            up_block_types=("UpDecoderBlock2D",) * blocks,
            **spec["vae"],
        ),
        text_encoder=CLIPTextModel(CLIPTextConfig(max_position_embeddings=77, **ids, **spec["clip"])),
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(pipe_dir)
    AutoencoderTiny().save_pretrained(tiny_dir)  # madebyollin/taesd's layout, random weights
    return pipe_dir, tiny_dir


def time_ours(
    pipe_dir: Path, tiny_dir: Path | None, spec: dict, steps: list[int], dtype: str, speedups: dict, quantize=None
) -> dict:
    from engine import keep_freed_memory, load_pipeline, pair_cores

    # as the app runs on a CPU host: core pairs in f32, none in bf16 through oneDNN nor in oneDNN's int8
    pair_cores(dtype, int8=quantize == "w8a8")
    keep_freed_memory()  # as the app does
    vae = {"vae": str(tiny_dir)} if tiny_dir else {}
    pipe = load_pipeline(pipe_dir, dtype, **vae, previews=False, quantize=quantize)
    size, kwargs = spec["size"], dict(guidance_scale=spec["guidance"], scheduler=spec["scheduler"])
    kwargs.update(speedups)  # deep_cache, token_merging

    def picture(n: int) -> None:
        pipe.generate("a photo of a cat", height=size, width=size, num_inference_steps=n, **kwargs)

    return {n: best(lambda n=n: picture(n)) for n in steps}


def time_diffusers(pipe_dir: Path, tiny_dir: Path | None, spec: dict, steps: list[int], bf16: bool) -> dict:
    import torch
    from diffusers import AutoencoderTiny, StableDiffusionPipeline

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dtype = torch.bfloat16 if bf16 else torch.float32
    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, torch_dtype=dtype)
    if tiny_dir:
        pipe.vae = AutoencoderTiny.from_pretrained(tiny_dir, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    size = spec["size"]

    def picture(n: int) -> None:
        with torch.inference_mode():
            pipe("a photo of a cat", height=size, width=size, num_inference_steps=n, guidance_scale=spec["guidance"])

    return {n: best(lambda n=n: picture(n)) for n in steps}


def time_openvino(pipe_dir: Path, tiny_dir: Path, spec: dict, steps: list[int]) -> dict:
    """FastSD CPU's recipe without its app: the text encoder, the UNet and the TAESD decoder converted to OpenVINO
    (`openvino.convert_model` from the same diffusers modules; bench/requirements-openvino.txt) and compiled for
    the CPU in the precision OpenVINO picks there (bf16 where native), the scheduler diffusers' own."""
    import numpy as np
    import openvino as ov
    import torch
    from diffusers import AutoencoderTiny, StableDiffusionPipeline

    if spec["guidance"] > 1:
        raise SystemExit("openvino-taesd runs the unguided models only (one UNet row a step)")
    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir)
    tiny = AutoencoderTiny.from_pretrained(tiny_dir)
    size, cores = spec["size"], len(os.sched_getaffinity(0))
    side = size // pipe.vae_scale_factor
    ids = pipe.tokenizer("a photo of a cat", padding="max_length", max_length=77, return_tensors="pt").input_ids
    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": cores}

    class Wrapped(torch.nn.Module):  # one network, its first output as a plain tensor
        def __init__(self, network, call):
            super().__init__()
            self.network, self.call = network.requires_grad_(False), call

        def forward(self, *inputs):
            return self.call(self.network, *inputs)

    with torch.no_grad():
        states = pipe.text_encoder(ids, return_dict=False)[0]
        latent = torch.zeros(1, pipe.unet.config.in_channels, side, side)
        networks = dict(
            text=(pipe.text_encoder, lambda m, i: m(i, return_dict=False)[0], (ids,)),
            unet=(
                pipe.unet,
                lambda m, x, t, s: m(x, t, s, return_dict=False)[0],
                (latent, torch.tensor([999.0]), states),
            ),
            decoder=(tiny, lambda m, x: m.decode(x, return_dict=False)[0], (latent,)),
        )
        text, unet, decoder = (
            core.compile_model(ov.convert_model(Wrapped(network, call), example_input=example), "CPU", config)
            for network, call, example in networks.values()
        )
    print("openvino precision:", unet.get_property("INFERENCE_PRECISION_HINT"), file=sys.stderr)
    scheduler = pipe.scheduler

    def picture(n: int) -> None:
        tokens = pipe.tokenizer("a photo of a cat", padding="max_length", max_length=77, return_tensors="np")
        hidden = text(tokens.input_ids)[0]
        scheduler.set_timesteps(n)
        latents = torch.randn(1, pipe.unet.config.in_channels, side, side) * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            x = scheduler.scale_model_input(latents, t)
            eps = torch.from_numpy(unet([x.numpy(), np.array([float(t)], np.float32), hidden])[0])
            latents = scheduler.step(eps, t, latents).prev_sample
        image = decoder(latents.numpy())[0]
        pipe.image_processor.postprocess(torch.from_numpy(image), output_type="pil")

    return {n: best(lambda n=n: picture(n)) for n in steps}


def best(call, reps: int = 2) -> float:
    call()  # warm-up: compiles (ours) or fills caches (PyTorch)
    return best_time(call, reps)


SYSTEMS = (
    "ours-bf16-taesd",
    "ours-w8a8-taesd",
    "ours-taesd",
    "ours-kl",
    "diffusers-taesd",
    "diffusers-bf16-taesd",
    "diffusers-kl",
    "openvino-taesd",
)


def worker(system: str, model: str, folder: Path, steps: list[int], speedups: dict) -> dict:
    pipe_dir, tiny_dir = write_models(model, folder)
    tiny = tiny_dir if system.endswith("taesd") else None
    if system == "openvino-taesd":
        return time_openvino(pipe_dir, tiny_dir, MODELS[model], steps)
    if system.startswith("ours"):
        dtype = "bfloat16" if "bf16" in system else "float32"
        quantize = "w8a8" if "w8a8" in system else None
        return time_ours(pipe_dir, tiny, MODELS[model], steps, dtype, speedups, quantize)
    return time_diffusers(pipe_dir, tiny, MODELS[model], steps, bf16="bf16" in system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="sd-turbo")
    parser.add_argument("--steps", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=[s for s in SYSTEMS if s != "openvino-taesd"])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "jax-sd-bench-picture")
    parser.add_argument("--deep-cache", type=int, default=0, help="ours: a whole UNet pass every N steps (DeepCache)")
    parser.add_argument("--token-merging", type=float, default=0.0, help="ours: the share of tokens merged (ToMe)")
    parser.add_argument("--isa", choices=list(ISAS), default="native", help="cap every system's instruction set")
    parser.add_argument("--dry-run", action="store_true", help="print the header and each system's caps, run nothing")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        speedups = dict(deep_cache=args.deep_cache, token_merging=args.token_merging)
        print(json.dumps(worker(args.worker, args.model, args.folder, args.steps, speedups)), flush=True)
        return
    env = isa_environment(args.isa, WORKER_ENV)
    if args.dry_run:
        print(cpu_header(args.isa))
        for system in args.systems:
            caps = [f"{name}={env[name]}" for name in (*CAP_VARIABLES, "XLA_FLAGS") if name in env]
            print(f"{system}: {' '.join(caps) or 'no cap'}")
        return
    args.folder.mkdir(parents=True, exist_ok=True)
    write_models(args.model, args.folder)
    rounds: dict[str, list[dict]] = {system: [] for system in args.systems}
    for _ in range(args.rounds):
        for system in args.systems:
            command = [sys.executable, __file__, "--worker", system, "--model", args.model]
            command += [
                "--folder",
                str(args.folder),
                "--steps",
                *map(str, args.steps),
                "--deep-cache",
                str(args.deep_cache),
            ]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"{system} failed:\n{done.stderr[-4000:]}")
            rounds[system].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    speedups = [f"deep_cache={args.deep_cache}"] * (args.deep_cache > 1)
    speedups += [f"token_merging={args.token_merging:g}"] * (args.token_merging > 0)
    cached = f", ours with {' and '.join(speedups)}" if speedups else ""
    print(cpu_header(args.isa))
    print(
        f"# {args.model}, {MODELS[args.model]['size']}px, seconds per picture, best of {args.rounds} round(s){cached}"
    )
    print("| system | " + " | ".join(f"{n} step{'s' * (n > 1)}" for n in args.steps) + " |")
    print("|---|" + "---|" * len(args.steps))
    for system, results in rounds.items():
        fastest = {n: min(r[str(n)] for r in results) for n in args.steps}
        print(f"| {system} | " + " | ".join(f"{fastest[n]:.2f}" for n in args.steps) + " |")
        print(
            json.dumps(
                {
                    "system": system,
                    "model": args.model,
                    "isa": args.isa,
                    "best_s": fastest,
                    "rounds": results,
                    "load": load,
                }
            )
        )


if __name__ == "__main__":
    main()
