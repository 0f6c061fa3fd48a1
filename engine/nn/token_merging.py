"""Token merging for Stable Diffusion (ToMe; Bolya & Hoffman, 2023; the `tomesd` package's bipartite soft matching):
the most redundant of an image's tokens are averaged into similar ones before a self-attention and copied back after.

The tokens of an h x w image are split into destinations, the top-left token of each 2x2 window, and sources, the
rest. Each source's most similar destination (cosine similarity of the block's input) is found; the `r` sources with
the most similar destinations are merged, each into its destination, by a mean, so the self-attention reads
N - r tokens. Unmerging gives every merged source its destination's output. As `tomesd.apply_patch(ratio,
use_rand=False)` with its defaults: the first level only (`max_downsample` 1), self-attention only.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def partition(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(sources, destinations): token indices of an h x w image in row-major order. A destination is the top-left
    token of each whole 2x2 window; tokens past the last whole window (an odd side) are sources."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    is_dst = (rows % 2 == 0) & (cols % 2 == 0) & (rows < h // 2 * 2) & (cols < w // 2 * 2)
    index = np.arange(h * w).reshape(h, w)
    return index[~is_dst], index[is_dst]


def bipartite_merge(metric: jax.Array, h: int, w: int, r: int) -> tuple[Callable, Callable]:
    """(merge, unmerge) for tokens [batch, h * w, c] whose similarity `metric` [batch, h * w, c] gives: `merge` maps
    [batch, h * w, d] -> [batch, h * w - r, d] (the unmerged sources, then the destinations, each the mean of itself
    and the sources merged into it), `unmerge` maps back, each merged source taking its destination's row."""
    src_idx, dst_idx = partition(h, w)
    r = min(r, len(src_idx))
    unit = metric.astype(jnp.float32)
    unit = unit / jnp.linalg.norm(unit, axis=-1, keepdims=True)
    scores = unit[:, src_idx] @ jnp.swapaxes(unit[:, dst_idx], 1, 2)  # [batch, sources, destinations]
    best = scores.max(axis=-1)
    # the first destination at the maximum: a min over indices, which XLA's CPU vectorizes (its argmax it does not)
    columns = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    best_dst = jnp.min(jnp.where(scores == best[..., None], columns, scores.shape[-1]), axis=-1)
    order = jnp.argsort(-best, axis=-1)  # the most similar sources first
    merged, kept = order[:, :r], order[:, r:]  # positions among the sources
    into = jnp.take_along_axis(best_dst, merged, axis=-1)  # [batch, r]: each merged source's destination

    def merge(x: jax.Array) -> jax.Array:
        def one(x, merged, kept, into):
            src, dst = x[src_idx], x[dst_idx]
            total = dst.astype(jnp.float32).at[into].add(src[merged].astype(jnp.float32))
            count = jnp.ones(len(dst_idx), jnp.float32).at[into].add(1.0)
            return jnp.concatenate([src[kept], (total / count[:, None]).astype(x.dtype)])

        return jax.vmap(one)(x, merged, kept, into)

    def unmerge(y: jax.Array) -> jax.Array:
        def one(y, merged, kept, into):
            unm, dst = y[: len(src_idx) - r], y[len(src_idx) - r :]
            out = jnp.zeros((h * w, y.shape[-1]), y.dtype).at[dst_idx].set(dst)
            sources = jnp.asarray(src_idx)
            out = out.at[sources[kept]].set(unm)
            return out.at[sources[merged]].set(dst[into])

        return jax.vmap(one)(y, merged, kept, into)

    return merge, unmerge
