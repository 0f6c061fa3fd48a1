"""Command line: `python -m engine generate "a prompt" --steps 25 --out out/`.

With `--image picture.png` it redraws a picture (image to image, `--strength`), and with `--mask mask.png`
too, only the mask's white part (inpainting).

Writes one PNG per image and, for several images, a grid; prints the seeds and timings.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from PIL import Image


def grid(images: list[Image.Image]) -> Image.Image:
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    sheet = Image.new("RGB", (cols * w, rows * h), "white")
    for k, image in enumerate(images):
        sheet.paste(image, ((k % cols) * w, (k // cols) * h))
    return sheet


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Stable Diffusion text-to-image in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate images from a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--negative", default="", help="negative prompt")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    gen.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale")
    gen.add_argument("--scheduler", default=None, help="pndm, ddim, euler, euler_a, dpm++2m, dpm++2m_karras")
    gen.add_argument("--height", type=int, default=None)
    gen.add_argument("--width", type=int, default=None)
    gen.add_argument("--images", type=int, default=None, help="number of images (default: one per device)")
    gen.add_argument("--model", default=None, help="a diffusers folder or Hub id (default: the embedded model)")
    gen.add_argument(
        "--vae",
        default=None,
        help="a VAE folder or Hub id in place of the model's own (madebyollin/taesd: a tiny one, fast on CPU)",
    )
    gen.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: bf16 on GPU/TPU and on a CPU with native bf16 and the oneDNN kernels, else f32",
    )
    gen.add_argument("--image", type=Path, default=None, help="start from this picture (image to image)")
    gen.add_argument("--mask", type=Path, default=None, help="with --image: redraw only the white part (inpainting)")
    gen.add_argument("--strength", type=float, default=None, help="with --image: how much is redrawn, 0 to 1")
    gen.add_argument("--out", type=Path, default=Path("out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from . import InvalidRequest, SourceError, WeightsError, enable_compile_cache, keep_freed_memory, load_pipeline
    from .compat.pnginfo import GenerationParameters, save_png
    from .errors import ConfigError
    from .sampling.pairs import pair_cores

    pair_cores(args.dtype)  # two CPU devices per image on a CPU host (engine/sampling/pairs.py), before JAX starts
    keep_freed_memory()  # XLA's CPU temporaries reused, not mapped afresh at every call (before JAX starts)
    enable_compile_cache()
    try:
        pictures = {}
        for name, path in (("image", args.image), ("mask_image", args.mask)):
            if path is not None:
                try:
                    with Image.open(path) as picture:
                        pictures[name] = picture.copy()
                except OSError as err:
                    raise InvalidRequest(f"cannot read --{name.split('_')[0]} {path}: {err}") from None
        # Files only: nothing to preview.
        pipe = load_pipeline(args.model, dtype=args.dtype, vae=args.vae, previews=False)
        result = pipe.generate(
            args.prompt,
            negative_prompt=args.negative,
            seed=args.seed,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            height=args.height,
            width=args.width,
            num_images=args.images,
            scheduler=args.scheduler,
            strength=args.strength,
            **pictures,
        )
    except (InvalidRequest, SourceError, WeightsError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for image, seed in zip(result.images, result.seeds, strict=True):
        # Each picture carries its recipe, as AUTOMATIC1111 writes it: the page's "PNG info" reads it back.
        save_png(
            image,
            args.out / f"seed{seed}.png",
            GenerationParameters.from_request(result.request, seed, pipe.model_name),
        )
    if len(result.images) > 1:
        grid(result.images).save(args.out / "grid.png")
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    t = result.timings
    print(f"{len(result.images)} image(s), seeds {result.seeds}, on {', '.join(sorted(set(result.devices)))}")
    print(f"compile {t['compile_s']:.2f} s, run {t['run_s']:.2f} s, total {t['total_s']:.2f} s -> {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
