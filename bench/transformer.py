"""One denoising step of the flow models' transformers on this machine: ours (JAX) against diffusers (PyTorch, CPU),
at their real widths, with the same random weights and the same inputs.

    python bench/transformer.py --model sd35-medium                       # SD 3.5 medium, all 24 blocks, 1024x1024
    python bench/transformer.py --model flux --layers 6                   # FLUX.1 dev at 2 + 4 of its 19 + 38 blocks
    python bench/transformer.py --model sd35-medium --batch 2 --rounds 2  # the guided step: 2 rows per image
    python bench/transformer.py --model flux --layers 1 --size 128 --rounds 1   # a smoke run

Models (random weights, the published configs' widths): `sd35-medium` is diffusers' `SD3Transformer2DModel` with
stabilityai/stable-diffusion-3.5-medium's transformer/config.json (24 joint blocks, 13 of them with the second,
image-only attention; 333 text tokens: 77 CLIP + 256 T5); `flux` is `FluxTransformer2DModel` with FLUX.1 dev's
(19 double- and 38 single-stream blocks, the guidance embedding; 512 text tokens). `--layers N` cuts the depth so a
run fits the machine: for SD 3.5, N joint blocks, the first round(13 N / 24) with the second attention; for FLUX, N
blocks in all, a third of them double-stream (round(N / 3), at least 1 of each kind), as in the full model (19:38).
Results give seconds per step and per block at the depth used (`layers`, `depth`), and a linear estimate at full depth.

The model is written once (`save_pretrained`, f32, by a process of its own) into `--folder` and read by both sides:
ours loads the transformer alone (`engine.loading.weights.read_safetensors` + `convert`, in `--dtype`) and times one
jitted call of `model(x, t, model.project_context(text), pooled)` (FLUX: `..., pooled, guidance)` with t / 1000),
the graph static and the parameters arguments of the program, as engine/sampling/pipeline.py passes them; x is the
NHWC latent [batch, size/8, size/8, 16]. Its compile (`lower().compile()`) is timed on its own. Ours runs on one
XLA CPU device (not the app's core pair: the transformer alone, not the engine's program). diffusers gets the same
numbers as its pipelines pass them (NCHW latents; FLUX: latents packed in 2x2 patches and the position ids, as
FluxPipeline makes them), `torch.inference_mode()`, `torch.set_num_threads(os.cpu_count())`.

Each system runs in a process of its own, the systems taking turns for `--rounds` rounds; each round loads the
model, makes `--warmup` untimed calls, then keeps the fastest of `--reps` timed calls; each system keeps its fastest
round. Prints a table (seconds per step and per block, load and compile seconds, each process's peak RSS, which
counts the weight files' pages mapped while loading), the ratio ours / diffusers, the largest difference between
their outputs (relative to diffusers' largest value), one JSON line per system, and the 1-minute load average
(repeat above 2).

`--batch` is rows per transformer call: a picture with classifier-free guidance (SD 3.5) runs 2 rows per step, so
`--batch 2` is its step; FLUX.1 dev embeds the guidance scale and runs 1 row per picture.

Memory: every process holds the whole model: the parameter count x 4 bytes in f32 (SD 3.5 medium: 2.47e9 parameters,
about 10 GB per process; FLUX.1: 11.9e9, about 48 GB, so on a 24 GB machine FLUX needs `--layers`). A depth whose
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
MODELS = {
    "sd35-medium": dict(config=SD35_MEDIUM, layers=24, text_tokens=77 + 256, latent_channels=16),
    "flux": dict(config=FLUX1_DEV, layers=19 + 38, text_tokens=512, latent_channels=16),
}
SYSTEMS = ("ours", "diffusers")
TIMESTEP = 0.5  # the flow's sigma: SD3 takes it x 1000, FLUX / 1000 of that (as FluxPipeline passes it)
GUIDANCE = 3.5  # FLUX.1 dev's embedded guidance scale
HEADROOM = 3 * 2**30  # bytes beside the parameters: activations at 1024x1024, the runtimes
WORKER_ENV = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "HF_HUB_OFFLINE": "1"}


def config_at(model: str, layers: int | None) -> dict:
    """The model's config cut to `layers` blocks (None: all of them)."""
    spec = MODELS[model]
    n = spec["layers"] if layers is None else layers
    if not 1 <= n <= spec["layers"]:
        raise SystemExit(f"--layers {n}: {model} has 1 to {spec['layers']} blocks")
    if model == "sd35-medium":
        dual = round(len(SD35_MEDIUM["dual_attention_layers"]) * n / spec["layers"])
        return dict(spec["config"], num_layers=n, dual_attention_layers=tuple(range(dual)))
    double = max(1, round(n * FLUX1_DEV["num_layers"] / spec["layers"]))
    return dict(spec["config"], num_layers=double, num_single_layers=max(1, n - double))


def blocks(config: dict) -> int:
    return config["num_layers"] + config.get("num_single_layers", 0)


def depth_words(config: dict) -> str:
    if "num_single_layers" in config:
        return f"{config['num_layers']} double + {config['num_single_layers']} single blocks"
    return f"{config['num_layers']} joint blocks ({len(config['dual_attention_layers'])} with attn2)"


def model_dir(folder: Path, model: str, config: dict) -> Path:
    return folder / f"{model}-{config['num_layers']}-{config.get('num_single_layers', 0)}"


def our_class(model: str):
    if model == "sd35-medium":
        from engine.models.transformer_sd3 import SD3Transformer2DModel, SD3TransformerConfig

        return SD3Transformer2DModel, SD3TransformerConfig
    from engine.models.transformer_flux import FluxTransformer2DModel, FluxTransformerConfig

    return FluxTransformer2DModel, FluxTransformerConfig


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
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    cls = SD3Transformer2DModel if model == "sd35-medium" else FluxTransformer2DModel
    start = time.perf_counter()
    transformer = cls(**config).eval()
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=folder))
    transformer.save_pretrained(partial, max_shard_size="2GB")  # small shards: the save's copy stays small
    partial.rename(target)  # whole or absent
    print(f"wrote {target} in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def inputs(model: str, size: int, batch: int) -> dict[str, np.ndarray]:
    """The same numbers for both sides: NHWC latents, text, pooled text (f32)."""
    spec, rng = MODELS[model], np.random.default_rng(0)
    side = size // 8
    return dict(
        x=rng.standard_normal((batch, side, side, spec["latent_channels"])).astype(np.float32),
        text=rng.standard_normal((batch, spec["text_tokens"], spec["config"]["joint_attention_dim"])).astype(
            np.float32
        ),
        pooled=rng.standard_normal((batch, spec["config"]["pooled_projection_dim"])).astype(np.float32),
    )


def time_ours(model: str, folder: Path, values: dict, dtype: str, warmup: int, reps: int) -> tuple[dict, np.ndarray]:
    from functools import partial

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from engine.loading.weights import convert, read_safetensors

    cls, config_cls = our_class(model)
    start = time.perf_counter()
    cfg = config_cls.from_json(folder / "config.json")
    tensors = read_safetensors(sorted(folder.glob("*.safetensors")))
    graphdef, params = convert(
        lambda: cls(cfg, nnx.Rngs(0)), tensors, "bfloat16" if dtype == "bfloat16" else np.float32
    )
    del tensors  # the file's mapping: the copies in `params` are what the program reads
    params = jax.device_put(params)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - start

    @partial(jax.jit, static_argnums=0)
    def step(graphdef, params, x, t, text, pooled, guidance):
        transformer = nnx.merge(graphdef, params)
        context = transformer.project_context(text)
        if guidance is None:
            return transformer(x, t, context, pooled)
        return transformer(x, t, context, pooled, guidance)

    b = values["x"].shape[0]
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    x, text, pooled = (jnp.asarray(values[k], jdtype) for k in ("x", "text", "pooled"))
    if model == "flux":
        t, guidance = jnp.full((b,), TIMESTEP, jnp.float32), jnp.full((b,), GUIDANCE, jnp.float32)
    else:
        t, guidance = jnp.full((b,), TIMESTEP * 1000, jnp.float32), None
    start = time.perf_counter()
    compiled = step.lower(graphdef, params, x, t, text, pooled, guidance).compile()
    compile_s = time.perf_counter() - start

    def call():
        return jax.block_until_ready(compiled(params, x, t, text, pooled, guidance))

    first_s, out = _first_and_best(call, warmup, reps)
    return dict(load_s=load_s, compile_s=compile_s, **first_s), np.asarray(out.astype(jnp.float32))


def time_diffusers(
    model: str, folder: Path, values: dict, dtype: str, warmup: int, reps: int
) -> tuple[dict, np.ndarray]:
    import torch

    torch.set_num_threads(os.cpu_count())
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    start = time.perf_counter()
    if model == "sd35-medium":
        from diffusers import SD3Transformer2DModel as cls
    else:
        from diffusers import FluxTransformer2DModel as cls
    transformer = cls.from_pretrained(folder, torch_dtype=tdtype).eval()
    load_s = time.perf_counter() - start

    x = torch.from_numpy(np.ascontiguousarray(values["x"].transpose(0, 3, 1, 2))).to(tdtype)  # NCHW
    text, pooled = (torch.from_numpy(values[k]).to(tdtype) for k in ("text", "pooled"))
    b, c, h, w = x.shape
    if model == "flux":
        from diffusers import FluxPipeline

        kwargs = dict(  # as FluxPipeline's loop calls it
            hidden_states=FluxPipeline._pack_latents(x, b, c, h, w),
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=torch.full((b,), TIMESTEP, dtype=tdtype),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", tdtype),
            txt_ids=torch.zeros(text.shape[1], 3, dtype=tdtype),
            guidance=torch.full([1], GUIDANCE, dtype=torch.float32).expand(b),
        )
    else:
        kwargs = dict(
            hidden_states=x,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=torch.full((b,), TIMESTEP * 1000, dtype=torch.float32),
        )

    def call():
        with torch.inference_mode():
            return transformer(**kwargs, return_dict=False)[0]

    first_s, out = _first_and_best(call, warmup, reps)
    if model == "flux":  # [b, tokens, 64] -> NCHW, as FluxPipeline unpacks (it takes the picture's size)
        out = FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)
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
    values = inputs(args.model, args.size, args.batch)
    timer = time_ours if args.child == "ours" else time_diffusers
    result, out = timer(args.model, folder, values, args.dtype, args.warmup, args.reps)
    np.save(args.folder / f"out-{args.child}.npy", out)
    result["finite"] = bool(np.isfinite(out).all())
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(json.dumps(result), flush=True)


def run_child(system: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", system, "--model", args.model, "--size", str(args.size)]
    command += ["--batch", str(args.batch), "--dtype", args.dtype, "--folder", str(args.folder)]
    command += ["--warmup", str(args.warmup), "--reps", str(args.reps)]
    command += ["--layers", str(args.layers)] if args.layers else []
    done = subprocess.run(command, capture_output=True, text=True, env=WORKER_ENV)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="sd35-medium")
    parser.add_argument("--layers", type=int, help="blocks to keep (default: all; FLUX: double + single)")
    parser.add_argument("--size", type=int, default=1024, help="pixels a side (a multiple of 16; latent = size / 8)")
    parser.add_argument("--batch", type=int, default=1, help="rows per call (2 for a guided SD 3.5 picture)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per round before the timed ones")
    parser.add_argument("--reps", type=int, default=1, help="timed calls per round (the fastest is kept)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: ours,diffusers")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "jax-sd-bench-transformer")
    parser.add_argument("--child", choices=(*SYSTEMS, "write"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        parser.error(f"--systems {args.systems!r}: a comma-separated choice of {', '.join(SYSTEMS)}")
    if args.size % 16 or args.size < 16:
        parser.error(f"--size {args.size}: a positive multiple of 16 (8 pixels a latent, 2 latents a token)")
    config = config_at(args.model, args.layers)
    count = check_memory(args.model, config)
    args.folder.mkdir(parents=True, exist_ok=True)
    run_child("write", args)  # in a process of its own: its memory is returned before the timed ones start
    rounds: dict[str, list[dict]] = {system: [] for system in systems}
    for _ in range(args.rounds):
        for system in systems:
            rounds[system].append(run_child(system, args))
    load = os.getloadavg()[0]
    n, full, side = blocks(config), MODELS[args.model]["layers"], args.size // 8
    image_tokens = (side // 2) ** 2
    print(
        f"# {args.model}, {depth_words(config)} ({n} of {full}), {args.size}px (latent {side}x{side}: {image_tokens} "
        f"image + {MODELS[args.model]['text_tokens']} text tokens), batch {args.batch}, {args.dtype}, "
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
    for row in rows.values():
        print(json.dumps(row))


if __name__ == "__main__":
    main()
