"""int8 compute against f32 at SD-Turbo's UNet shapes (512x512, one image), on a CPU without native bf16.

The UNet step is ~0.9 TFLOP, and a Zen 3 core pair computes f32 at ~0.2 TFLOP/s at best: only int8 (AVX2's
vpmaddubsw, twice f32's multiply-adds per cycle) can take a step under that bound. Three systems per shape, each one
jitted call with its kernel as an argument, as the engine passes its params:
- `f32`: XLA's f32, as `layers.Conv` and `layers.Linear` run it today (a convolution as `layers.gathered_conv`
  chooses);
- `xla8`: XLA's own int8, `lax.conv_general_dilated` / `lax.dot_general` on s8 x s8 -> s32 (symmetric per-tensor
  activations, per-channel weights), the activations' quantization and the dequantization inside the timing;
- `dnnl8`: engine/nn/int8.py's path (its output's relative RMS error against f32 printed beside it), oneDNN's u8 x s8 -> s32 kernels (int8.cc; a linear layer as a 1x1
  convolution) with the kernel pinned (reordered once, as an `Engine` pins its params), the dynamic per-tensor
  quantization of the activations (u8 with a zero point), the padding and the dequantization inside the timing.
Best of `--rounds`; the systems take turns within a round, so a busy minute slows one round, not one system. The
machine this runs on is usually shared: the ratios are what it says, measured on loaded cores.

    python bench/kernels_int8.py --rounds 5
    python bench/kernels_int8.py --unet --rounds 2   # SD-Turbo's whole UNet, one step, f32 against w8a8

`--unet` times SD-Turbo's UNet (random weights of its shape, 512x512, batch 1) in f32 and with `--quantize w8a8`'s
kernels, its int8 ones pinned, the two taking turns: minutes of both cores (its 865M parameters drawn, two programs
compiled), and on shared cores each call's time swings by a factor of two, so its best of rounds is what to read.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (batch, h, w, in, out, kernel): the UNet's 3x3 convolutions at its four levels, a 1x1 shortcut
CONVS = [
    (1, 64, 64, 320, 320, 3),
    (1, 32, 32, 640, 640, 3),
    (1, 16, 16, 1280, 1280, 3),
    (1, 8, 8, 1280, 1280, 3),
    (1, 32, 32, 320, 640, 1),
]
# (M, K, N): attention's projections, GEGLU's in and the feed-forward's out at each level with attention
MATMULS = [
    (4096, 320, 320),
    (4096, 320, 2560),
    (4096, 1280, 320),
    (1024, 640, 640),
    (1024, 640, 5120),
    (1024, 2560, 640),
    (256, 1280, 1280),
    (256, 1280, 10240),
    (256, 5120, 1280),
]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx_vnni", "avx512_vnni", "amx_int8")


def cpu_line() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in FLAGS)
    return f"{model} ({platform.machine()}), {len(os.sched_getaffinity(0))} cores: {have}"


def timed_ms(fn, args, calls: int) -> float:
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
    parser.add_argument("--unet", action="store_true", help="SD-Turbo's whole UNet step instead of the shapes")
    args = parser.parse_args()
    if args.unet:
        unet_step(args.rounds)
        return

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax import lax

    from engine.nn import int8, layers, onednn

    if not onednn.registered():  # built whatever the CPU
        sys.exit("the oneDNN kernels are not built here (the log says why)")
    print(cpu_line())
    print(f"load average {os.getloadavg()[0]:.2f}: the machine is shared and was not quiet; best of {args.rounds}")

    def xla8_conv(x, values, scale, bias, strides, padding):
        """XLA's int8: symmetric per-tensor s8 activations, s8 x s8 -> s32, dequantized with the bias."""
        step = jnp.maximum(jnp.max(jnp.abs(x)), 1e-30) / 127.0
        q = jnp.clip(jnp.round(x / step), -127, 127).astype(jnp.int8)
        acc = lax.conv_general_dilated(q, values, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                       preferred_element_type=jnp.int32)  # fmt: skip
        return acc.astype(jnp.float32) * (step * scale) + bias

    def xla8_matmul(x, values, scale, bias):
        step = jnp.maximum(jnp.max(jnp.abs(x)), 1e-30) / 127.0
        q = jnp.clip(jnp.round(x / step), -127, 127).astype(jnp.int8)
        acc = lax.dot_general(q, values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * (step * scale) + bias

    cases = []  # (name, gflop, {system: (fn, args)}, the quantized kernel to pin)
    key = jax.random.key(0)
    for b, h, w, cin, cout, k in CONVS:
        layer = layers.conv(cin, cout, k, nnx.Rngs(0))
        x = jax.nn.silu(jax.random.normal(key, (b, h, w, cin)))  # as a ResNet block's GroupNorm + SiLU feeds it
        kernel, bias = layer.kernel[...], layer.bias[...]
        pad = ((k // 2, k // 2),) * 2
        quantized = jax.device_put(int8.quantize_kernel(kernel))  # pinned only on the device, as an Engine's
        graph, state = nnx.split(layer)
        systems = {
            "f32": (jax.jit(lambda x, state, graph=graph: nnx.merge(graph, state)(x)), (x, state)),
            "xla8": (jax.jit(lambda x, v, s, b, pad=pad: xla8_conv(x, v, s, b, (1, 1), pad)),
                     (x, quantized.values, quantized.scale, bias)),
            "dnnl8": (jax.jit(lambda x, q, b, pad=pad: int8.conv(x, q, b, (1, 1), pad)), (x, quantized, bias)),
        }  # fmt: skip
        gflop = 2 * b * h * w * cin * cout * k * k / 1e9
        cases.append((f"conv {k}x{k} {h}x{w} {cin}->{cout}", gflop, systems, quantized))
    for m, kk, n in MATMULS:
        layer = layers.linear(kk, n, nnx.Rngs(0))
        x = jax.random.normal(key, (m, kk))
        kernel, bias = layer.kernel[...], layer.bias[...]
        quantized = jax.device_put(int8.quantize_kernel(kernel))  # pinned only on the device, as an Engine's
        graph, state = nnx.split(layer)
        systems = {
            "f32": (jax.jit(lambda x, state, graph=graph: nnx.merge(graph, state)(x)), (x, state)),
            "xla8": (jax.jit(xla8_matmul), (x, quantized.values, quantized.scale, bias)),
            "dnnl8": (jax.jit(int8.matmul), (x, quantized, bias)),
        }
        cases.append((f"matmul {m}x{kk}x{n}", 2 * m * kk * n / 1e9, systems, quantized))

    print(f"{'shape':28} {'GFLOP':>6} {'f32 ms':>8} {'xla8 ms':>8} {'dnnl8 ms':>9} {'f32/xla8':>9} {'f32/dnnl8':>9}"
          f" {'dnnl8 err':>9}")  # fmt: skip
    totals = {"f32": 0.0, "xla8": 0.0, "dnnl8": 0.0}
    for name, gflop, systems, quantized in cases:
        if args.only not in name:
            continue
        pinned = onednn.pin({}, int8_values=int8.kernel_values(quantized))  # its int8 values, reordered once
        try:
            for fn, call_args in systems.values():
                fn(*call_args).block_until_ready()  # compiled; oneDNN's primitive made, the pinned kernel reordered
            best = dict.fromkeys(systems, float("inf"))
            for _ in range(args.rounds):
                for system, (fn, call_args) in systems.items():
                    best[system] = min(best[system], timed_ms(fn, call_args, args.calls))
        finally:
            pinned.release()
        for system in totals:
            totals[system] += best[system]
        want, got = (np.asarray(systems[s][0](*systems[s][1]), np.float64) for s in ("f32", "dnnl8"))
        err = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))  # relative RMS error of the int8 output
        print(
            f"{name:28} {gflop:6.2f} {best['f32']:8.2f} {best['xla8']:8.2f} {best['dnnl8']:9.2f} "
            f"{best['f32'] / best['xla8']:8.2f}x {best['f32'] / best['dnnl8']:8.2f}x {err:8.2%}   "
            f"({gflop / best['f32'] * 1e3:.0f} / {gflop / best['xla8'] * 1e3:.0f} / "
            f"{gflop / best['dnnl8'] * 1e3:.0f} GFLOP/s)",
            flush=True,
        )
    print(
        f"{'all shapes above, summed':28} {'':6} {totals['f32']:8.1f} {totals['xla8']:8.1f} {totals['dnnl8']:9.1f} "
        f"{totals['f32'] / totals['xla8']:8.2f}x {totals['f32'] / totals['dnnl8']:8.2f}x"
    )
    print(f"load average {os.getloadavg()[0]:.2f}")


def unet_step(rounds: int) -> None:
    """SD-Turbo's UNet, one call at 512x512 (64x64 latents, batch 1, 77 tokens of context), f32 against w8a8."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from picture import SD2_UNET

    from engine.loading.quantize import quantize_params
    from engine.models.config import UNetConfig
    from engine.models.unet import UNet2DConditionModel
    from engine.nn import int8, onednn

    print(cpu_line())
    graph, params = nnx.split(UNet2DConditionModel(UNetConfig(**SD2_UNET), nnx.Rngs(0)))
    quantized = quantize_params(nnx.State({"unet": params}), "unet", mode="w8a8")["unet"]
    # On the device as an Engine puts them: pin keeps only device buffers, and numpy leaves would be copied per call
    params, quantized = jax.device_put(params), jax.device_put(quantized)
    pinned = onednn.pin(quantized, int8_values=int8.kernel_values(quantized))  # as an Engine pins its params
    x = jax.random.normal(jax.random.key(0), (1, 64, 64, 4))
    context = jax.random.normal(jax.random.key(1), (1, 77, 1024))
    step = jax.jit(lambda p, x, c: nnx.merge(graph, p)(x, jnp.asarray([999.0]), c))
    systems = {"f32": params, "w8a8": quantized}
    for p in systems.values():
        step(p, x, context).block_until_ready()  # compiled
    best, outs = dict.fromkeys(systems, float("inf")), {}
    for _ in range(rounds):
        for name, p in systems.items():
            start = time.perf_counter()
            outs[name] = np.asarray(step(p, x, context), np.float64)
            best[name] = min(best[name], time.perf_counter() - start)
    pinned.release()
    err = np.sqrt(np.mean((outs["w8a8"] - outs["f32"]) ** 2) / np.mean(outs["f32"] ** 2))
    print(f"UNet step, best of {rounds}: f32 {best['f32']:.2f} s, w8a8 {best['w8a8']:.2f} s "
          f"({best['f32'] / best['w8a8']:.2f}x); w8a8's output {err:.1%} RMS off f32's (random weights)")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
