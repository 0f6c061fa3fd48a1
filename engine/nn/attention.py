"""Scaled dot-product attention, one formulation per backend and shape.

All take and return [batch, tokens, heads, head_dim] and compute softmax(q k^T / sqrt(d)) v with f32
logits. Which one runs is `attention_kind`'s choice, a pure function of the backend and the shapes:

- "cudnn": cuDNN's fused kernel on GPU, for the half-precision head sizes it takes.
- "flash": the Pallas flash attention kernel for TPU that JAX ships, for long self-attention (the
  threshold google/maxdiffusion uses, 4096 tokens); short sequences such as the 77-token
  cross-attention gain nothing from it.
- "blocks": on the CPU, a block of queries at a time, logits keys-major. The plain formulation writes
  all the logits, [2, 8, 1024, 1024] f32 (64 MB) at SD 1.5's first level at 256x256, and then reads
  them three times (max, exp-sum, normalise): memory-bound. A block's logits stay in the cache.
- "onednn": on the CPU in bf16 with the oneDNN kernels (`onednn.attention`): one custom call, 256 queries of
  one head at a time, both products in oneDNN and the f32 softmax between them (AVX-512 exponentials). SD 2.1's
  4096-token self-attention (5 heads) 127 ms in XLA's bf16 query blocks -> 66 ms with 64-query blocks and
  libm's exp -> 33 ms; SD3's 4429 tokens x 24 heads 4.5x faster than the same blocks with XLA's softmax.
  In f32 too, for long self-attention where the kernels are loaded anyway (CPU_ONEDNN_F32_KEYS), with AVX2
  exponentials.
- "plain": two einsums and a softmax; everywhere else.

A key mask ([batch, tokens_k], True where a key may be attended: a batch of texts of unequal lengths, as Z-Image
pads its captions) runs in cuDNN where it takes one, else in the query blocks where the logits are large, else
plainly; the oneDNN and flash kernels take none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import onednn

FLASH_MIN_TOKENS = 4096  # TPU: self-attention at least this long uses the flash kernel (maxdiffusion's default)
FLASH_LANES = 128  # the TPU kernel's kv block must be a multiple of this; wider heads a multiple of it too
# CPU: logits larger than this go block by block, each block at most CPU_BLOCK_ROWS queries and about
# CPU_BLOCK_BYTES of logits. Measured alone on one core, plain -> blocks: [2, 1024, 8, 8] 99 -> 23 ms,
# [2, 1024, 8, 40] 113 -> 52 ms, [2, 1024, 1, 64] 20 -> 9.5 ms, the 77-token cross-attention 4.3 -> 1.4 ms.
CPU_LOGITS_BYTES = 4 << 20
CPU_BLOCK_BYTES = 4 << 20
CPU_BLOCK_ROWS = 128
# CPU, f32: self-attention over at least this many keys runs in the oneDNN kernel where it is loaded anyway
# (`onednn.loaded`: bf16 layers, `--quantize w8a8`'s int8 products). SD 2.1's 4096-token self-attention on a
# Zen 3 core pair (AVX2): XLA's query blocks 2.8 s -> 1.5 s (loaded cores); the 77-token cross-attention is
# faster in XLA's plain formulation (14 ms against 70: the kernel's per-block work does not pay for 77 keys).
CPU_ONEDNN_F32_KEYS = 1024


def softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The plain formulation: logits, softmax and weights in full.

    Two plain einsums: on the CPU this runs the UNet twice as fast as `jax.nn.dot_product_attention`'s
    XLA path at SD's shapes (which carries an extra grouped-query dimension in every dot).
    `mask` [tokens_q, tokens_k], True where attention is allowed.
    """
    q = q * q.shape[-1] ** -0.5  # q, not the logits: on the CPU the whole UNet runs 1.6x faster so
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [batch, heads, tokens_q, tokens_k]
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def query_block(q_shape: tuple[int, ...], kv_tokens: int) -> int:
    """The CPU's block of queries: at most CPU_BLOCK_ROWS, about CPU_BLOCK_BYTES of f32 logits. A divisor of the
    count when one comes within half of that; otherwise the budget itself, and `blockwise_attention` pads the
    queries to whole blocks (SD3 at 1024x1024 has 4429 = 43 x 103 tokens: a divisor would be one row)."""
    b, n, h, _ = q_shape
    want = min(CPU_BLOCK_ROWS, max(1, CPU_BLOCK_BYTES // (4 * b * h * kv_tokens)), n)
    divisor = max(d for d in range(1, want + 1) if n % d == 0)
    return divisor if 2 * divisor >= want else want


def keys_major_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None = None) -> jax.Array:
    """`softmax_attention` with the logits laid out [batch, heads, tokens_k, tokens_q].

    The softmax's max and sum then run over a major axis, vectorised across queries; over the
    minor axis XLA's CPU reductions go one row at a time. 20-40% faster inside a query block on the CPU.
    `key_mask` [batch, tokens_k]: True where a key may be attended.
    """
    q = q * q.shape[-1] ** -0.5
    logits = jnp.einsum("bkhd,bqhd->bhkq", k, q, preferred_element_type=jnp.float32)
    if key_mask is not None:
        logits = jnp.where(key_mask[:, None, :, None], logits, jnp.finfo(jnp.float32).min)
    weights = jnp.exp(logits - jnp.max(logits, axis=2, keepdims=True))  # unnormalised
    total = jnp.sum(weights, axis=2)  # [batch, heads, tokens_q]
    out = jnp.einsum("bhkq,bkhd->bqhd", weights.astype(v.dtype), v)
    return (out / jnp.swapaxes(total, 1, 2)[..., None]).astype(v.dtype)


def blockwise_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, block: int, key_mask: jax.Array | None = None
) -> jax.Array:
    """Attention over `block` queries at a time (a loop, not unrolled): each block's logits stay in the cache.
    Queries are padded to whole blocks; the padded rows attend like any other and are cut from the output."""
    b, n, h, d = q.shape
    padded = n + -n % block
    q = _pad(q, 1, padded - n)
    blocks = q.reshape(b, padded // block, block, h, d).swapaxes(0, 1)  # [blocks, batch, block, heads, head_dim]
    out = jax.lax.map(lambda qb: keys_major_attention(qb, k, v, key_mask), blocks)
    return out.swapaxes(0, 1).reshape(b, padded, h, d)[:, :n]


def _flash_block(tokens: int) -> int:
    # The largest of the kernel's usual tiles that divides the (padded) length.
    return next(size for size in (512, 256, 128) if tokens % size == 0)


def _pad(a: jax.Array, axis: int, amount: int) -> jax.Array:
    return jnp.pad(a, [(0, amount if i == axis else 0) for i in range(a.ndim)]) if amount else a


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """JAX's Pallas flash attention kernel for TPU (`jax.experimental.pallas.ops.tpu.flash_attention`).

    The kernel wants [batch, heads, tokens, head_dim], lengths in whole 128-token blocks, and heads of at
    most 128 or a multiple of 128. Both lengths are padded to a multiple of 128; padded keys are masked
    out by segment ids (id 0; every query and real key has id 1) and padded queries are cut from the
    output. Heads wider than 128 are zero-padded to a multiple of 128, which changes no logit.
    """
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu  # Pallas is imported only where used

    b, n, h, d = q.shape
    m = k.shape[1]
    pad_n, pad_m = -n % FLASH_LANES, -m % FLASH_LANES
    pad_d = -d % FLASH_LANES if d > FLASH_LANES else 0
    q = _pad(_pad(q, 1, pad_n), 3, pad_d).swapaxes(1, 2)  # [batch, heads, tokens, head_dim]
    k, v = (_pad(_pad(a, 1, pad_m), 3, pad_d).swapaxes(1, 2) for a in (k, v))
    segments = None
    if pad_m:
        kv_ids = jnp.broadcast_to(jnp.arange(m + pad_m) < m, (b, m + pad_m)).astype(jnp.int32)
        segments = tpu.SegmentIds(q=jnp.ones((b, n + pad_n), jnp.int32), kv=kv_ids)
    block_q, block_k = _flash_block(n + pad_n), _flash_block(m + pad_m)
    sizes = tpu.BlockSizes(block_q=block_q, block_k_major=block_k, block_k=block_k, block_b=1)
    out = tpu.flash_attention(q, k, v, segment_ids=segments, sm_scale=d**-0.5, block_sizes=sizes)
    return out.swapaxes(1, 2)[:, :n, :, :d]


def attention_kind(backend: str, q: jax.ShapeDtypeStruct, k: jax.ShapeDtypeStruct) -> str:
    """Which formulation runs for q [batch, tokens_q, heads, head_dim], k [batch, tokens_k, heads, head_dim]."""
    b, n, h, d = q.shape
    m = k.shape[1]
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    if backend == "gpu" and half and d % 8 == 0:
        return "cudnn"
    if backend == "tpu" and min(n, m) >= FLASH_MIN_TOKENS:
        return "flash"
    if backend == "cpu" and q.dtype == jnp.bfloat16 and onednn.serves(q.dtype):
        return "onednn"
    if backend == "cpu" and q.dtype == jnp.float32 and m >= CPU_ONEDNN_F32_KEYS and onednn.loaded():
        return "onednn"
    if backend == "cpu" and 4 * b * h * n * m > CPU_LOGITS_BYTES and query_block(q.shape, m) < n:
        return "blocks"
    return "plain"


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v over [batch, tokens, heads, head_dim], by `attention_kind`'s choice.

    `key_mask` [batch, tokens_k] (bool): True where a key may be attended; the others weigh nothing.
    """
    kind = attention_kind(jax.default_backend(), q, k)
    if key_mask is not None:
        return masked_attention(kind, q, k, v, key_mask)
    if kind == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError):  # a shape cuDNN does not take, or no cuDNN
            pass
    if kind == "flash":
        return flash_attention(q, k, v)
    if kind == "blocks":
        return blockwise_attention(q, k, v, query_block(q.shape, k.shape[1]))
    if kind == "onednn":
        return onednn.attention(q, k, v)
    return softmax_attention(q, k, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`dot_product_attention` where query i sees keys 0..i (the text encoders' self-attention): in one oneDNN-side
    call where attention runs there (the SD-Turbo text encoder's 23 attentions of 77 tokens: about 6 ms of 91 on
    2 Xeon cores with AMX), cuDNN's on the GPU, else the plain formulation under a lower-triangular mask."""
    kind = attention_kind(jax.default_backend(), q, k)
    if kind == "onednn":
        return onednn.attention(q, k, v, causal=True)
    if kind == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError):
            pass
    n, m = q.shape[1], k.shape[1]
    return softmax_attention(q, k, v, jnp.tril(jnp.ones((n, m), bool)))


def masked_attention(kind: str, q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array) -> jax.Array:
    """`dot_product_attention` with a key mask: cuDNN's kernel where it takes it, the oneDNN-side call where attention
    runs there (Z-Image's padded captions: its bf16 step at 3 blocks on 2 Xeon cores with AMX 1.08 -> 0.85 s), the CPU's
    query blocks where the logits are large, else the plain formulation."""
    if kind == "onednn":
        return onednn.attention(q, k, v, key_mask=key_mask)
    if kind == "cudnn":
        try:
            mask = key_mask[:, None, None, :]  # [batch, heads, tokens_q, tokens_k], broadcast
            return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError):
            pass
    b, n, h, _ = q.shape
    m = k.shape[1]
    if jax.default_backend() == "cpu" and 4 * b * h * n * m > CPU_LOGITS_BYTES and query_block(q.shape, m) < n:
        return blockwise_attention(q, k, v, query_block(q.shape, m), key_mask)
    return softmax_attention(q, k, v, key_mask[:, None, None, :])
