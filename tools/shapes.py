"""The procedural data set the embedded default model is trained on: flat shapes on a flat background.

A scene is one shape (or, now and then, two) of one colour on a background of another, drawn
anti-aliased at 64x64 and described by a caption such as "a red circle on a blue background",
"a small green star on a white background" or "a red circle and a blue square on a yellow background".
Some colour-shape pairs never appear in training (`HELD_OUT`), so that the evaluation can ask
whether the model composes a colour and a shape it has only seen apart.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image, ImageDraw

SIDE = 64  # image side in pixels: latents are 8x8 with the factor-8 VAE
SUPERSAMPLE = 4  # draw at 4x and box-filter down, for anti-aliased edges like a real render

# Far enough apart in RGB that the nearest-colour rule of `tools.evaluate` cannot confuse them.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (245, 220, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "orange": (245, 140, 20),
    "purple": (140, 40, 180),
}
SHAPES = ("circle", "square", "triangle", "star")
# Radius (half the side of the bounding square) in pixels, by the size word in the caption.
SIZES: dict[str, tuple[float, float]] = {"small": (9.0, 12.0), "": (12.0, 19.0), "large": (19.0, 25.0)}
# Never drawn in training, in any scene: the model must compose these from what it has seen.
HELD_OUT: frozenset[tuple[str, str]] = frozenset(
    {("red", "star"), ("blue", "triangle"), ("green", "circle"), ("yellow", "square"), ("purple", "square")}
)
TWO_OBJECTS = 0.1  # share of training scenes with a second shape
WORDS = sorted({"a", "an", "and", "on", "background", *COLOURS, *SHAPES, *[s for s in SIZES if s]})


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    size: str  # a key of SIZES ("" when the caption names no size)
    cx: float
    cy: float
    radius: float


@dataclasses.dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[Shape, ...]

    @property
    def caption(self) -> str:
        objects = " and ".join(_article(f"{s.size} {s.colour} {s.kind}".strip()) for s in self.shapes)
        return f"{objects} on {_article(self.background)} background"


def _article(words: str) -> str:
    return ("an " if words[0] in "aeiou" else "a ") + words


def caption(colour: str, kind: str, background: str, size: str = "") -> str:
    return Scene(background, (Shape(kind, colour, size, 0.0, 0.0, 0.0),)).caption


def polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of an upright square, triangle or five-pointed star in a box of half-side `r`."""
    if kind == "square":
        r = r * 0.9  # a square fills its box; shrink it to about a circle's visual weight
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if kind == "triangle":
        # Equilateral, pointing up, centred on its bounding box.
        h = r * 2 * math.sqrt(3) / 2
        return [(cx, cy - h / 2), (cx + r, cy + h / 2), (cx - r, cy + h / 2)]
    if kind == "star":
        points = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.42
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + rad * math.cos(angle), cy + rad * math.sin(angle) + r * 0.1))
        return points
    raise ValueError(f"no polygon for {kind!r}")


def render(scene: Scene) -> np.ndarray:
    """The scene as uint8 [SIDE, SIDE, 3]."""
    s = SUPERSAMPLE
    image = Image.new("RGB", (SIDE * s, SIDE * s), COLOURS[scene.background])
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        cx, cy, r, fill = shape.cx * s, shape.cy * s, shape.radius * s, COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon(polygon(shape.kind, cx, cy, r), fill=fill)
    return np.asarray(image.resize((SIDE, SIDE), Image.Resampling.BOX))


def _pick(rng: np.random.Generator, options) -> str:
    options = sorted(options)  # a fixed order, so that a seed gives the same scenes in every process
    return options[rng.integers(len(options))]


def sample_scene(rng: np.random.Generator, held_out: bool = False, two: bool | None = None) -> Scene:
    """A random training scene (colour-shape pairs from HELD_OUT excluded), or with `held_out` only those."""
    background = _pick(rng, COLOURS)
    two = rng.random() < TWO_OBJECTS if two is None else two
    shapes: list[Shape] = []
    used_colours = {background}
    for slot in range(2 if two else 1):
        while True:
            colour, kind = _pick(rng, set(COLOURS) - used_colours), _pick(rng, SHAPES)
            if ((colour, kind) in HELD_OUT) == held_out:
                break
        used_colours.add(colour)
        if two:
            # Side by side, left then right as the caption reads, no overlap.
            size = _pick(rng, ("small", ""))
            radius = rng.uniform(*SIZES["small"]) if size == "small" else rng.uniform(11.0, 14.0)
            half = SIDE / 2
            cx = rng.uniform(radius + 1, half - radius) if slot == 0 else rng.uniform(half + radius, SIDE - radius - 1)
        else:
            size = _pick(rng, SIZES)
            radius = rng.uniform(*SIZES[size])
            cx = rng.uniform(radius + 1, SIDE - radius - 1)
        cy = rng.uniform(radius + 1, SIDE - radius - 1)
        shapes.append(Shape(kind, colour, size, float(cx), float(cy), float(radius)))
    return Scene(background, tuple(shapes))


def batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[str]]:
    """n training scenes: images float32 [n, SIDE, SIDE, 3] in [-1, 1], and their captions."""
    scenes = [sample_scene(rng) for _ in range(n)]
    images = np.stack([render(s) for s in scenes]).astype(np.float32) / 127.5 - 1.0
    return images, [s.caption for s in scenes]


def single_object_triples(held_out: bool) -> list[tuple[str, str, str]]:
    """Every (colour, shape, background) of one object, seen in training or held out."""
    return [
        (colour, kind, background)
        for colour in COLOURS
        for kind in SHAPES
        for background in COLOURS
        if colour != background and ((colour, kind) in HELD_OUT) == held_out
    ]
