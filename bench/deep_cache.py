"""What DeepCache (`deep_cache=N`) costs in quality, on the embedded model: a trained one, so its pictures mean
something (random weights would only show how far two noises are apart).

For each of the model's example prompts and a few seeds, the picture drawn with `deep_cache=N` is compared with the
one drawn whole at every step, from the same seed: PSNR in dB (higher is closer; identical pictures are infinite) and
the largest difference of a pixel channel (0-255). Beside it, seconds per batch of pictures for each N, best of
`--rounds`, in this one process (the speed on real-sized models: `picture.py --deep-cache N`).

    python bench/deep_cache.py                      # 20 DDIM steps, the model's defaults
    python bench/deep_cache.py --steps 8 --every 2 3 4
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
    parser.add_argument("--every", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from engine import keep_freed_memory, load_pipeline

    keep_freed_memory()
    pipe = load_pipeline()
    prompts = list(pipe.example_prompts)
    steps = args.steps or pipe.defaults["num_inference_steps"]

    def draw(every: int) -> np.ndarray:
        pictures = [
            pipe.generate(prompt, seed=0, num_images=args.seeds, num_inference_steps=steps, deep_cache=every).arrays
            for prompt in prompts
        ]
        return (np.concatenate(pictures) * 255).round().astype(np.uint8)

    whole = draw(0)
    rows = []
    for every in [0, *args.every]:
        pictures = draw(every)  # also the warm-up of this plan's programs
        seconds = math.inf
        for _ in range(args.rounds):
            start = time.perf_counter()
            draw(every)
            seconds = min(seconds, time.perf_counter() - start)
        scores = [psnr(p, w) for p, w in zip(pictures, whole, strict=True)]
        rows.append(
            dict(
                deep_cache=every,
                psnr_db_mean=float(np.mean([min(s, 99.0) for s in scores])),
                psnr_db_worst=float(min(scores)),
                max_abs_diff=int(np.abs(pictures.astype(int) - whole.astype(int)).max()),
                seconds=seconds / len(prompts),
            )
        )
    print(f"# the embedded model, {steps} steps, {len(prompts)} prompts x {args.seeds} seeds, 1-min load "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| deep_cache | PSNR mean (dB) | PSNR worst (dB) | largest difference (0-255) | seconds per batch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['deep_cache'] or 'off'} | {r['psnr_db_mean']:.1f} | {r['psnr_db_worst']:.1f} | "
            f"{r['max_abs_diff']} | {r['seconds']:.3f} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
