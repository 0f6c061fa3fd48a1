"""diffusers' `StableDiffusionSafetyChecker`, with the `CLIPImageProcessor` in front of it, on the devices.

SD 1.x folders ship `safety_checker/` (a CLIP ViT, its projection, 17 concept and 3 "special care"
embeddings, one threshold each) and `feature_extractor/preprocessor_config.json`. A picture is
flagged when the cosine between its CLIP embedding and a concept embedding passes that concept's
threshold; passing a special-care threshold lowers every concept threshold by 0.01.

Everything is a traced array function of the decoded pictures, so one jitted program can decode
and check in the same batch: `check(graphdef, params, images)`, with the preprocessing config
static inside the graphdef.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn.layers import linear
from .clip_vision import CLIPVisionModel, bare_param
from .config import FeatureExtractorConfig, SafetyCheckerConfig

# diffusers builds the checker with these counts; a checkpoint with others is refused as mis-shaped.
CONCEPTS, SPECIAL_CARE = 17, 3
# What passing a special-care threshold adds to the later scores (diffusers' `adjustment`).
SPECIAL_CARE_ADJUSTMENT = 0.01


class SafetyResult(NamedTuple):
    has_nsfw_concepts: jax.Array  # [batch] bool: the picture must not be shown
    concept_scores: jax.Array  # [batch, 17] f32: cosine - threshold (+ 0.01 after special care), rounded to 0.001
    special_scores: jax.Array  # [batch, 3] f32: the same for the special-care concepts


PRECISION_BITS = 22  # PIL's fixed point for 8-bit pictures (32 - 8 - 2)


def _pil_bicubic_filter(x: float) -> float:
    """PIL's `bicubic_filter`: Keys' cubic convolution with a = -0.5."""
    a, x = -0.5, abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


@functools.lru_cache(maxsize=32)
def pil_bicubic_weights(in_size: int, out_size: int) -> np.ndarray:
    """PIL's `precompute_coeffs` then `normalize_coeffs_8bpc` for BICUBIC: int32 [in_size, out_size].

    The same double arithmetic in the same order, so the fixed-point coefficients are PIL's own.
    The filter widens by the scale when shrinking (antialiasing), and each output's taps are
    renormalised to sum to one where the border cuts them off.
    """
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support, ss = 2.0 * filterscale, 1.0 / filterscale
    weights = np.zeros((in_size, out_size), np.int32)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin, xmax = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), in_size)
        taps = [_pil_bicubic_filter((x - center + 0.5) * ss) for x in range(xmin, xmax)]
        ww = 0.0
        for w in taps:  # summed in order, as PIL does
            ww += w
        for x, w in zip(range(xmin, xmax), taps, strict=True):
            w = w / ww if ww != 0.0 else w
            weights[x, xx] = int((-0.5 if w < 0 else 0.5) + w * (1 << PRECISION_BITS))  # C's cast: toward zero
    return weights


def _pil_pass(levels: jax.Array, weights: np.ndarray, spec: str) -> jax.Array:
    """One pass of PIL's 8-bit resampling: integer sums, rounded by the half added, clipped to uint8."""
    sums = jnp.einsum(spec, levels, jnp.asarray(weights), preferred_element_type=jnp.int32)
    return jnp.clip((sums + (1 << (PRECISION_BITS - 1))) >> PRECISION_BITS, 0, 255)


def pil_bicubic_resize(x: jax.Array, height: int, width: int) -> jax.Array:
    """PIL's `Image.resize(..., BICUBIC)` of uint8 pictures held as f32 levels [batch, H, W, C]: bit-exact.

    PIL resizes the width, stores uint8, then resizes the height, all in 22-bit fixed point; so do
    we, in int32 on the device (the taps of one output never sum past int32, as in PIL's C).
    `jax.image.resize(..., "bicubic")` computes the same filter in f32 without the rounding between
    passes: 0.28 levels off on average against PIL, and up to 6 when enlarging, where PIL clips the
    first pass's overshoot; rounding between its passes brings it to 99.9% equal, one level apart
    elsewhere. Scores at the thresholds move with such differences, so we take PIL's exact path.
    """
    b, h, w, c = x.shape
    levels = x.astype(jnp.int32)
    if w != width:
        levels = _pil_pass(levels, pil_bicubic_weights(w, width), "bhwc,wo->bhoc")
    if h != height:
        levels = _pil_pass(levels, pil_bicubic_weights(h, height), "bhwc,ho->bowc")
    return levels.astype(jnp.float32)


def resized_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """transformers' `get_resize_output_image_size(..., default_to_square=False)`: the long side truncated."""
    short, long = min(height, width), max(height, width)
    new_long = int(shortest_edge * long / short)
    return (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)


def preprocess(cfg: FeatureExtractorConfig, images: jax.Array) -> jax.Array:
    """Decoded pictures [batch, H, W, 3] in [0, 1] -> pixel values [batch, crop_h, crop_w, 3] (NHWC).

    What diffusers does between the VAE and the checker: the pictures become uint8 (`numpy_to_pil`),
    then `CLIPImageProcessor` resizes the shortest edge with PIL, crops the centre, rescales by
    1/255 and normalises with the CLIP mean and std.
    """
    x = jnp.round(images.astype(jnp.float32) * 255.0)  # uint8 levels, as diffusers' numpy_to_pil
    if cfg.do_resize:
        x = pil_bicubic_resize(x, *resized_size(x.shape[1], x.shape[2], cfg.size))
    if cfg.do_center_crop:
        (crop_h, crop_w), (h, w) = cfg.crop_size, x.shape[1:3]
        if crop_h > h or crop_w > w:
            raise ValueError(f"pictures of {h}x{w} are smaller than the crop {crop_h}x{crop_w}")
        top, left = (h - crop_h) // 2, (w - crop_w) // 2
        x = x[:, top : top + crop_h, left : left + crop_w]
    if cfg.do_rescale:
        x = x * cfg.rescale_factor
    if cfg.do_normalize:
        x = (x - jnp.asarray(cfg.image_mean, jnp.float32)) / jnp.asarray(cfg.image_std, jnp.float32)
    return x


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """torch's `normalize` (eps 1e-12) of both, then a @ b.T, in f32 at full precision: thresholds are sharp."""
    a = a / jnp.maximum(jnp.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / jnp.maximum(jnp.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return jnp.einsum("bd,nd->bn", a, b, precision=jax.lax.Precision.HIGHEST)  # [batch, concepts]


def flags(
    concept_cos: jax.Array, special_cos: jax.Array, concept_thresholds: jax.Array, special_thresholds: jax.Array
) -> SafetyResult:
    """diffusers' per-picture loop in `StableDiffusionSafetyChecker.forward`, over the batch at once.

    As there, every score is rounded to 3 decimals (`round(score, 3)`, in f32) before it is compared
    with 0, and the 0.01 adjustment joins the special-care scores after the first one over 0
    (diffusers sets it inside that loop) and every concept score once any special-care one is.
    The scores may differ from numpy's in the last bit (XLA divides by 1000 with a reciprocal); the
    flags do not, as the sign of the rounded score is that of the rounded integer.
    """
    special = special_cos - special_thresholds  # [batch, 3]
    over = jnp.round(special, 3) > 0  # [batch, 3], before any adjustment
    after_first = (jnp.cumsum(over, axis=1) - over) > 0  # an earlier special-care score was over 0
    special_scores = jnp.round(special + SPECIAL_CARE_ADJUSTMENT * after_first, 3)
    adjustment = SPECIAL_CARE_ADJUSTMENT * jnp.any(over, axis=1, keepdims=True)  # [batch, 1]
    concept_scores = jnp.round(concept_cos - concept_thresholds + adjustment, 3)  # [batch, 17]
    return SafetyResult(jnp.any(concept_scores > 0, axis=1), concept_scores, special_scores)


class SafetyChecker(nnx.Module):
    """`StableDiffusionSafetyChecker`: normalised pixel values [batch, 224, 224, 3] -> `SafetyResult`."""

    def __init__(self, cfg: SafetyCheckerConfig, feature_extractor: FeatureExtractorConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.feature_extractor = feature_extractor  # static: `check` finds it in the graphdef
        self.vision_model = CLIPVisionModel(cfg.vision_config, rngs)
        self.visual_projection = linear(cfg.vision_config.hidden_size, cfg.projection_dim, rngs, bias=False)
        self.concept_embeds = bare_param(CONCEPTS, cfg.projection_dim)
        self.special_care_embeds = bare_param(SPECIAL_CARE, cfg.projection_dim)
        self.concept_embeds_weights = bare_param(CONCEPTS)  # the thresholds
        self.special_care_embeds_weights = bare_param(SPECIAL_CARE)

    def image_embeds(self, pixel_values: jax.Array) -> jax.Array:
        """[batch, projection_dim] in f32: the projected pooled output that the concepts are compared with."""
        return self.visual_projection(self.vision_model(pixel_values).pooled).astype(jnp.float32)

    def __call__(self, pixel_values: jax.Array) -> SafetyResult:
        embeds = self.image_embeds(pixel_values)
        f32 = lambda p: p[...].astype(jnp.float32)  # noqa: E731
        return flags(
            _cosine(embeds, f32(self.concept_embeds)),
            _cosine(embeds, f32(self.special_care_embeds)),
            f32(self.concept_embeds_weights),
            f32(self.special_care_embeds_weights),
        )


def check(graphdef: nnx.GraphDef, params: nnx.State, images: jax.Array) -> SafetyResult:
    """Decoded pictures [batch, H, W, 3] in [0, 1] (what `pipeline.decode` returns) -> `SafetyResult`.

    Pure and jittable with `graphdef` static; call it inside the decode program to check the batch
    where it was drawn. A new picture size compiles anew (the resize depends on it).
    """
    checker: SafetyChecker = nnx.merge(graphdef, params)
    return checker(preprocess(checker.feature_extractor, images))
