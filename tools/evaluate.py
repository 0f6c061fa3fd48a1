"""Does a model draw what it is asked? Simple image analysis of one-shape pictures, and an accuracy report.

    python -m tools.evaluate                    # the embedded default model, its default settings
    python -m tools.evaluate --model DIR --seeds 0 1 2

For each prompt of `PROMPTS` ("a red circle on a blue background", held-out colour-shape pairs
included) the model draws a picture, and `analyse` reads back three things:
  background  the median of the 2-pixel border, named by the nearest colour of `tools.shapes.COLOURS`;
  foreground  the largest 4-connected blob of pixels far from the background, its core's median colour;
  shape       from two ratios of that blob: solidity (area / convex hull area) tells a star (~0.55)
              from the convex shapes (~1), then extent (area / bounding box area) orders
              square (~1) > circle (pi/4) > triangle (1/2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tools.shapes import COLOURS, HELD_OUT, caption

PALETTE_NAMES = list(COLOURS)
PALETTE = np.array([COLOURS[n] for n in PALETTE_NAMES], np.float32) / 255.0  # [colours, rgb]
FAR = 0.25  # RGB distance (in [0, 1] units) beyond which a pixel is not background; palette gaps are >= 0.35
MIN_AREA = 16  # pixels: a smaller blob is noise, not a drawn object

# A fixed evaluation set: every colour as foreground and as background, every shape, and the held-out pairs.
PROMPTS: tuple[tuple[str, str, str], ...] = (
    ("red", "circle", "blue"),
    ("green", "square", "white"),
    ("blue", "star", "yellow"),
    ("yellow", "triangle", "black"),
    ("white", "circle", "purple"),
    ("black", "square", "orange"),
    ("orange", "triangle", "green"),
    ("purple", "star", "white"),
    ("red", "square", "yellow"),
    ("green", "triangle", "red"),
    ("blue", "circle", "orange"),
    ("yellow", "star", "purple"),
    ("white", "triangle", "blue"),
    ("black", "star", "green"),
    ("orange", "circle", "black"),
    ("purple", "triangle", "yellow"),
    # held out: never drawn in training
    ("red", "star", "white"),
    ("blue", "triangle", "green"),
    ("green", "circle", "yellow"),
    ("yellow", "square", "blue"),
    ("purple", "square", "orange"),
    ("red", "star", "black"),
    ("blue", "triangle", "white"),
    ("green", "circle", "purple"),
)


@dataclasses.dataclass(frozen=True)
class Analysis:
    background: str
    foreground: str | None  # None: nothing drawn
    shape: str | None
    area: int = 0
    extent: float = 0.0
    solidity: float = 0.0


def nearest_colour(rgb: np.ndarray) -> str:
    return PALETTE_NAMES[int(np.argmin(np.linalg.norm(PALETTE - rgb, axis=-1)))]


def largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask, by a flood fill from each unvisited pixel."""
    h, w = mask.shape
    label = np.zeros(mask.shape, np.int32)
    sizes = [0]
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if label[y0, x0]:
            continue
        sizes.append(0)
        current, stack = len(sizes) - 1, [(y0, x0)]
        label[y0, x0] = current
        while stack:
            y, x = stack.pop()
            sizes[current] += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not label[ny, nx]:
                    label[ny, nx] = current
                    stack.append((ny, nx))
    if len(sizes) == 1:
        return np.zeros_like(mask)
    return label == int(np.argmax(sizes))


def hull_area(points: np.ndarray) -> float:
    """Area of the convex hull of [n, 2] points (Andrew's monotone chain, then the shoelace formula)."""
    pts = sorted(set(map(tuple, points.tolist())))
    if len(pts) < 3:
        return 0.0

    def half(seq):
        chain: list[tuple[float, float]] = []
        for p in seq:
            while len(chain) >= 2:
                (ax, ay), (bx, by) = chain[-2], chain[-1]
                if (bx - ax) * (p[1] - ay) - (by - ay) * (p[0] - ax) > 0:
                    break
                chain.pop()
            chain.append(p)
        return chain[:-1]

    hull = np.array(half(pts) + half(reversed(pts)))
    x, y = hull[:, 0], hull[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def classify_shape(extent: float, solidity: float) -> str:
    if solidity < 0.8:
        return "star"
    if extent > 0.88:
        return "square"
    if extent > 0.66:
        return "circle"
    return "triangle"


def analyse(image: np.ndarray) -> Analysis:
    """image: [h, w, 3], float in [0, 1] or uint8."""
    image = np.asarray(image, np.float32)
    if image.max() > 1.5:
        image = image / 255.0
    border = np.concatenate([image[:2].reshape(-1, 3), image[-2:].reshape(-1, 3)])
    border = np.concatenate([border, image[:, :2].reshape(-1, 3), image[:, -2:].reshape(-1, 3)])
    bg_rgb = np.median(border, axis=0)
    distance = np.linalg.norm(image - bg_rgb, axis=-1)  # [h, w]
    blob = largest_blob(distance > FAR)
    area = int(blob.sum())
    background = nearest_colour(bg_rgb)
    if area < MIN_AREA:
        return Analysis(background, None, None, area)
    # The core (the blob eroded by one pixel) avoids the blended colours along the edge.
    core = blob.copy()
    core[1:] &= blob[:-1]
    core[:-1] &= blob[1:]
    core[:, 1:] &= blob[:, :-1]
    core[:, :-1] &= blob[:, 1:]
    foreground = nearest_colour(np.median(image[core if core.any() else blob], axis=0))
    ys, xs = np.nonzero(blob)
    extent = area / float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    # Hull over pixel corners, so that it covers whole pixels as the area counts them.
    corners = np.concatenate([np.stack([xs + dx, ys + dy], -1) for dx in (0, 1) for dy in (0, 1)])
    solidity = area / max(hull_area(corners), 1.0)
    return Analysis(background, foreground, classify_shape(extent, solidity), area, extent, solidity)


@dataclasses.dataclass(frozen=True)
class Report:
    rows: list[dict[str, Any]]

    def accuracy(self, field: str, held_out: bool | None = None) -> float:
        rows = [r for r in self.rows if held_out is None or r["held_out"] == held_out]
        return float(np.mean([r[field + "_ok"] for r in rows])) if rows else float("nan")

    def summary(self) -> dict[str, float]:
        out = {}
        for field in ("foreground", "background", "shape"):
            out[field] = self.accuracy(field)
            out[field + "_seen"] = self.accuracy(field, held_out=False)
            out[field + "_held_out"] = self.accuracy(field, held_out=True)
        out["colour"] = (out["foreground"] + out["background"]) / 2
        return out


def evaluate(
    draw: Callable[[str, Sequence[int]], Sequence[np.ndarray]],
    prompts: Sequence[tuple[str, str, str]] = PROMPTS,
    seeds: Sequence[int] = (0,),
) -> Report:
    """`draw(prompt, seeds)` returns an image [h, w, 3] for each seed; each prompt is drawn once per seed."""
    rows = []
    for colour, kind, background in prompts:
        prompt = caption(colour, kind, background)
        for seed, image in zip(seeds, draw(prompt, seeds), strict=True):
            a = analyse(image)
            rows.append(
                {
                    "prompt": prompt,
                    "seed": seed,
                    "held_out": (colour, kind) in HELD_OUT,
                    "got": f"{a.foreground} {a.shape} on {a.background}",
                    "foreground_ok": a.foreground == colour,
                    "background_ok": a.background == background,
                    "shape_ok": a.shape == kind,
                    "extent": round(a.extent, 3),
                    "solidity": round(a.solidity, 3),
                }
            )
    return Report(rows)


def consecutive_runs(seeds: Sequence[int], longest: int) -> list[list[int]]:
    """`seeds` cut into runs of consecutive values, in order, each at most `longest` long."""
    runs: list[list[int]] = []
    for seed in seeds:
        if runs and len(runs[-1]) < longest and seed == runs[-1][-1] + 1:
            runs[-1].append(seed)
        else:
            runs.append([seed])
    return runs


def engine_drawer(pipe, **settings) -> Callable[[str, Sequence[int]], list[np.ndarray]]:
    """`draw` for an `engine.Engine` with its default settings (or `settings` over them).

    Consecutive seeds are drawn as one request of as many images (image k's seed is the request's plus k), a batch
    at most: the pictures one request per seed draws (to within 3e-5), for less. On the embedded model (2 Zen 3
    cores) one request of four pictures took 0.85 s of CPU time, four requests of one 1.4 s."""

    def draw(prompt: str, seeds: Sequence[int]) -> list[np.ndarray]:
        images = []
        for run in consecutive_runs(seeds, pipe.batch_size):
            images += list(pipe.generate(prompt, seed=run[0], num_images=len(run), **settings).arrays)
        return images

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a diffusers folder (default: the embedded model)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--guidance", type=float, default=None)
    parser.add_argument("--scheduler", default=None)
    parser.add_argument("--json", action="store_true", help="print the rows and summary as JSON")
    args = parser.parse_args()
    from engine import load_pipeline

    pipe = load_pipeline(args.model)
    settings = {
        k: v
        for k, v in (
            ("num_inference_steps", args.steps),
            ("guidance_scale", args.guidance),
            ("scheduler", args.scheduler),
        )
        if v is not None
    }
    start = time.perf_counter()
    report = evaluate(engine_drawer(pipe, **settings), seeds=args.seeds)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"rows": report.rows, "summary": report.summary()}, indent=2))
        return
    for r in report.rows:
        marks = "".join("." if r[f + "_ok"] else "x" for f in ("foreground", "shape", "background"))
        tag = " (held out)" if r["held_out"] else ""
        print(f"{marks}  {r['prompt']!r} seed {r['seed']}{tag}: got {r['got']}")
    print(f"{len(report.rows)} images in {seconds:.1f} s")
    for name, value in report.summary().items():
        print(f"  {name:22s} {value:.3f}")


if __name__ == "__main__":
    main()
