"""Hires fix's latent upscalers: the first pass's latents resized as A1111 resizes them, with torch's
`nn.functional.interpolate` in one of its modes, before the second pass draws from them.

A1111's `latent_upscale_modes` name six: bilinear and bicubic, each with and without antialiasing, nearest and
nearest-exact. Each is a resampling matrix per axis here ([out, in], built on the host in float64), applied to
the latents [n, h, w, c] along h then w, which is what torch's separable kernels compute:
- bilinear (align_corners=False): source x = (i + 0.5) * in/out - 0.5, clamped at 0, between its two neighbours;
- bicubic: the same source, Keys' cubic with a = -0.75 over four neighbours, indices clamped at the edges;
- antialiased (torch's `_upsample_*_aa`): the filter (triangle, or cubic with a = -0.5) centred on (i + 0.5) *
  in/out, its support widened by in/out when shrinking, the weights inside the picture normalised to 1;
- nearest: floor(i * in/out); nearest-exact: floor((i + 0.5) * in/out).
"""

from __future__ import annotations

import numpy as np

# A1111's name -> (torch's mode, antialias)
LATENT_UPSCALERS = {
    "Latent": ("bilinear", False),
    "Latent (antialiased)": ("bilinear", True),
    "Latent (bicubic)": ("bicubic", False),
    "Latent (bicubic antialiased)": ("bicubic", True),
    "Latent (nearest)": ("nearest", False),
    "Latent (nearest-exact)": ("nearest-exact", False),
}


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _antialiased(size_in: int, size_out: int, mode: str) -> np.ndarray:
    scale = size_in / size_out
    support = (1.0 if mode == "bilinear" else 2.0) * max(scale, 1.0)
    inv = 1.0 / max(scale, 1.0)
    matrix = np.zeros((size_out, size_in))
    for i in range(size_out):
        center = scale * (i + 0.5)
        low, high = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), size_in)
        j = np.arange(low, high)
        x = (j - center + 0.5) * inv
        w = np.maximum(0.0, 1.0 - np.abs(x)) if mode == "bilinear" else _cubic(x, -0.5)
        matrix[i, low:high] = w / w.sum()
    return matrix


def resampling_matrix(size_in: int, size_out: int, mode: str, antialias: bool = False) -> np.ndarray:
    """[size_out, size_in]: torch's `interpolate(..., size=size_out, mode, antialias)` along one axis."""
    if antialias:
        return _antialiased(size_in, size_out, mode)
    scale = size_in / size_out
    i = np.arange(size_out)
    matrix = np.zeros((size_out, size_in))
    if mode in ("nearest", "nearest-exact"):
        offset = 0.5 if mode == "nearest-exact" else 0.0
        matrix[i, np.minimum(np.floor((i + offset) * scale).astype(int), size_in - 1)] = 1.0
        return matrix
    source = (i + 0.5) * scale - 0.5
    if mode == "bilinear":
        source = np.maximum(source, 0.0)
        low = np.floor(source).astype(int)
        t = source - low
        np.add.at(matrix, (i, np.minimum(low, size_in - 1)), 1 - t)
        np.add.at(matrix, (i, np.minimum(low + 1, size_in - 1)), t)
        return matrix
    if mode == "bicubic":
        low = np.floor(source).astype(int)
        t = source - low
        for k in range(-1, 3):
            np.add.at(matrix, (i, np.clip(low + k, 0, size_in - 1)), _cubic(t - k, -0.75))
        return matrix
    raise ValueError(f"unknown resampling mode {mode!r}")


def upscale_latents(latents: np.ndarray, height: int, width: int, upscaler: str) -> np.ndarray:
    """Latents [n, h, w, c] resized to [n, height, width, c] by one of `LATENT_UPSCALERS`, in float32."""
    mode, antialias = LATENT_UPSCALERS[upscaler]
    rows = resampling_matrix(latents.shape[1], height, mode, antialias)
    cols = resampling_matrix(latents.shape[2], width, mode, antialias)
    out = np.einsum("oh,nhwc->nowc", rows, latents.astype(np.float64))
    return np.einsum("pw,nowc->nopc", cols, out).astype(np.float32)


def hires_steps(steps: int, hires_steps: int) -> int:
    """The second pass's steps: its own, or (0) the first pass's; `strength` then runs a share of them."""
    return int(hires_steps) or int(steps)
