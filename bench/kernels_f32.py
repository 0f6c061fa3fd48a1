"""oneDNN's f32 matrix products and convolutions against XLA's f32, at SD-Turbo's layer shapes (512x512, one image).

Where the CPU has no native bf16 (AVX2, AVX-512 without BF16) the engine runs f32; this asks whether its layers
should call oneDNN's f32 JIT kernels (engine/nn/onednn.py, the same custom calls as the bf16 path, with f32
kernels) instead of XLA's own dots and convolutions. Each shape is one jitted call with the kernel as an argument,
as the engine passes its params: XLA's f32 path as `layers.Conv` and `layers.Linear` take it today (a convolution
as `layers.gathered_conv` chooses), oneDNN's with the kernel reordered at every call, and oneDNN's with the kernel
pinned (reordered once, as an `Engine` pins its params). Best of `--rounds`, each round timing a few calls; the
systems take turns within a round, so a busy minute slows one round, not one system. Also our own f32 loops
(GroupNorm + SiLU, GEGLU, attention) against XLA's.

    python bench/kernels_f32.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (batch, h, w, in, out, kernel): the UNet's 3x3s at its four levels, a 1x1 shortcut, the 64x64 upsampler's conv
CONVS = [
    (1, 64, 64, 320, 320, 3),
    (1, 32, 32, 640, 640, 3),
    (1, 16, 16, 1280, 1280, 3),
    (1, 8, 8, 1280, 1280, 3),
    (1, 32, 32, 320, 640, 3),
    (1, 64, 64, 640, 320, 1),
]
# (M, K, N): attention's projections, GEGLU's and the feed-forward's out at each level, the text's keys
MATMULS = [
    (4096, 320, 320),
    (4096, 320, 2560),
    (4096, 1280, 320),
    (1024, 640, 640),
    (1024, 640, 5120),
    (1024, 2560, 640),
    (256, 1280, 10240),
    (256, 5120, 1280),
    (77, 1024, 1280),
]


def cpu_line() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    return f"{model} ({platform.machine()}), {len(os.sched_getaffinity(0))} cores: {have}"


def best_ms(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="calls timed per round")
    parser.add_argument("--only", default="", help="only the shapes whose name holds this (e.g. 'conv 3x3 64x64')")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from engine.nn import attention, layers, onednn

    if not onednn.registered():  # built whatever the CPU (the engine builds them only where it uses them)
        sys.exit("the oneDNN kernels are not built here (the log says why)")
    print(cpu_line())
    print(f"load average {os.getloadavg()[0]:.2f}: the machine is shared and was not quiet; best of {args.rounds}")

    cases = []  # (name, gflop, {system: (fn, args)})
    key = jax.random.key(0)
    for b, h, w, cin, cout, k in CONVS:
        layer = layers.conv(cin, cout, k, nnx.Rngs(0))
        x = jax.random.normal(key, (b, h, w, cin))
        kernel, bias = layer.kernel[...], layer.bias[...]
        pad = ((k // 2, k // 2),) * 2

        graph, state = nnx.split(layer)

        def xla(x, state, graph=graph):
            return nnx.merge(graph, state)(x)

        def ours(x, kernel, bias=bias, pad=pad):
            return onednn.conv(x, kernel, bias, (1, 1), pad, jnp.float32)

        gflop = 2 * b * h * w * cin * cout * k * k / 1e9
        cases.append((f"conv {k}x{k} {h}x{w} {cin}->{cout}", gflop, kernel, (x, state), (x, kernel), xla, ours))
    for m, kk, n in MATMULS:
        layer = layers.linear(kk, n, nnx.Rngs(0))
        x = jax.random.normal(key, (m, kk))
        kernel, bias = layer.kernel[...], layer.bias[...]

        graph, state = nnx.split(layer)

        def xla(x, state, graph=graph):
            return nnx.merge(graph, state)(x)

        def ours(x, kernel, bias=bias):
            return onednn.matmul(x, kernel, bias, jnp.float32)

        cases.append((f"matmul {m}x{kk}x{n}", 2 * m * kk * n / 1e9, kernel, (x, state), (x, kernel), xla, ours))

    print(f"{'shape':32} {'GFLOP':>6} {'XLA ms':>8} {'oneDNN ms':>10} {'pinned ms':>10} {'XLA/pinned':>10}")
    for name, gflop, kernel, xla_args, call_args, xla, ours in cases:
        if args.only not in name:
            continue
        systems = {"xla": jax.jit(xla), "onednn": jax.jit(ours)}
        systems["xla"](*xla_args).block_until_ready()  # compiled
        systems["onednn"](*call_args).block_until_ready()  # compiled, and oneDNN's primitive made
        best = {name: float("inf") for name in ("xla", "onednn", "pinned")}
        for _ in range(args.rounds):
            best["xla"] = min(best["xla"], best_ms(systems["xla"], xla_args, args.calls))
            best["onednn"] = min(best["onednn"], best_ms(systems["onednn"], call_args, args.calls))
            pinned = onednn.pin({"kernel": kernel}, dtypes=(jnp.float32,))
            try:
                systems["onednn"](*call_args).block_until_ready()  # reordered once
                best["pinned"] = min(best["pinned"], best_ms(systems["onednn"], call_args, args.calls))
            finally:
                pinned.release()
        print(
            f"{name:32} {gflop:6.2f} {best['xla']:8.2f} {best['onednn']:10.2f} {best['pinned']:10.2f} "
            f"{best['xla'] / best['pinned']:9.2f}x   ({gflop / best['xla'] * 1e3:.0f} vs "
            f"{gflop / best['pinned'] * 1e3:.0f} GFLOP/s)",
            flush=True,
        )

    print(f"{'our loops (f32)':32} {'':6} {'XLA ms':>8} {'ours ms':>10}")
    norm = layers.group_norm(320, 32, 1e-5, nnx.Rngs(0))
    loops = [
        ("group_norm+silu 64x64x320", jax.random.normal(key, (1, 64, 64, 320)),
         lambda x: norm(x, silu=True), lambda x: onednn.group_norm(x, norm.scale[...], norm.bias[...], 32, 1e-5, True)),
        ("geglu 4096x2560", jax.random.normal(key, (4096, 2560)),
         lambda y: (lambda h, g: h * jax.nn.gelu(g, approximate=False))(*jnp.split(y, 2, axis=-1)), onednn.geglu),
    ]  # fmt: skip
    # Attention at SD 2.1's 64x64 level (4096 tokens, 5 heads of 64): XLA's query blocks (what runs where the kernels
    # are not loaded) against onednn.attention; logits of the usual spread, and ten times wider (most keys' weights
    # underflow, where denormal products would cost a slow path).
    for gain in (1.0, 10.0):
        qkv = jax.random.normal(key, (3, 1, 4096, 5, 64)) * jnp.asarray([gain, 1.0, 1.0])[:, None, None, None, None]
        block = attention.query_block(qkv.shape[1:], 4096)
        loops.append(
            (
                f"attention 4096x5x64 x{gain:g}",
                qkv,
                lambda a, block=block: attention.blockwise_attention(*a, block),
                lambda a: onednn.attention(*a),
            )
        )
    for name, x, xla, ours in loops:
        if args.only not in name:
            continue
        fns = [jax.jit(xla), jax.jit(ours)]
        for fn in fns:
            fn(x).block_until_ready()
        times = [min(best_ms(fn, (x,), args.calls) for _ in range(args.rounds)) for fn in fns]
        print(f"{name:32} {'':6} {times[0]:8.2f} {times[1]:10.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
