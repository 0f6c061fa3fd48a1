"""What the optional speed-ups cost in quality, on the embedded model: a trained one, so its pictures mean
something (random weights would only show how far two noises are apart). DeepCache (`deep_cache=N`: a whole UNet
pass every N steps) and token merging (`token_merging=r`: that share of the first level's tokens merged).

For each of the model's example prompts and a few seeds, the picture drawn with a speed-up is compared with the one
drawn without, from the same seed: PSNR in dB (higher is closer; identical pictures are infinite) and the largest
difference of a pixel channel (0-255). Beside it, seconds per prompt's batch, best of `--rounds`, in this one
process (the speed on real-sized models: `picture.py --deep-cache N --token-merging r`).

    python bench/speedups.py                        # 20 DDIM steps, the model's defaults
    python bench/speedups.py --steps 8 --deep-cache 2 3 --token-merging 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="default: the model's own (20)")
    parser.add_argument("--deep-cache", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--token-merging", type=float, nargs="+", default=[0.3, 0.5])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from engine import keep_freed_memory, load_pipeline

    keep_freed_memory()
    pipe = load_pipeline()
    prompts = list(pipe.example_prompts)
    steps = args.steps or pipe.defaults["num_inference_steps"]

    def draw(**speedup) -> np.ndarray:
        pictures = [
            pipe.generate(prompt, seed=0, num_images=args.seeds, num_inference_steps=steps, **speedup).arrays
            for prompt in prompts
        ]
        return (np.concatenate(pictures) * 255).round().astype(np.uint8)

    variants = [{}] + [dict(deep_cache=n) for n in args.deep_cache]
    variants += [dict(token_merging=r) for r in args.token_merging]
    whole = draw()
    rows = []
    for speedup in variants:
        pictures = draw(**speedup)  # also the warm-up of this plan's programs
        seconds = math.inf
        for _ in range(args.rounds):
            start = time.perf_counter()
            draw(**speedup)
            seconds = min(seconds, time.perf_counter() - start)
        scores = [psnr(p, w) for p, w in zip(pictures, whole, strict=True)]
        rows.append(
            dict(
                speedup=", ".join(f"{k}={v}" for k, v in speedup.items()) or "off",
                psnr_db_mean=float(np.mean([min(s, 99.0) for s in scores])),
                psnr_db_worst=float(min(scores)),
                max_abs_diff=int(np.abs(pictures.astype(int) - whole.astype(int)).max()),
                seconds=seconds / len(prompts),
            )
        )
    print(f"# the embedded model, {steps} steps, {len(prompts)} prompts x {args.seeds} seeds, 1-min load "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| speed-up | PSNR mean (dB) | PSNR worst (dB) | largest difference (0-255) | seconds per batch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['speedup']} | {r['psnr_db_mean']:.1f} | {r['psnr_db_worst']:.1f} | "
            f"{r['max_abs_diff']} | {r['seconds']:.3f} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
