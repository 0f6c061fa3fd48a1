"""The fixed part of an SD-Turbo picture at 512x512 (what a request costs besides its UNet steps), piece by piece, on
a CPU without native bf16.

A 1-step picture is one UNet step plus a fixed part: the text encoder (OpenCLIP ViT-H's text tower, 23 layers of
1024, 77 tokens: ~20 GFLOP), the TAESD decoder (64x64 latents -> 512x512: ~140 GFLOP, most of it 64-channel 3x3
convolutions at 256x256 and 512x512) and the host's work on the picture (f32 -> uint8, a PIL image, its PNG). Each
network is one jitted call with its params as an argument, as the engine passes them (random weights of the real
shapes), in the variants the engine could run it in:
- `f32`: XLA's f32, as the engine runs a network on such a CPU today;
- `dnnl32`: oneDNN's f32 convolutions and matrix products (the `JAX_SD_ONEDNN=1` switch), kernels pinned;
- `w8a8`: `--quantize w8a8`'s int8 kernels (oneDNN's where they load, as the engine chooses) (engine/nn/int8.py) for the inner convolutions and linear layers, pinned,
  its output's relative RMS error against f32's printed beside it.
Best of `--rounds`; the variants take turns within a round, so a busy minute slows one round, not one variant. The
machine this runs on is usually shared: the numbers are what it says, measured on loaded cores.

    python bench/fixed_part.py --rounds 3

Measured on 2 Zen 3 cores (AMD EPYC, AVX2 only) shared with other work (load average 11), best of 3, seconds:
text encoder f32 2.31, dnnl32 2.61, w8a8 1.48 (3.7% RMS off f32, random weights); TAESD decode f32 5.69, dnnl32
6.69, w8a8 3.83 (3.7%); the host's uint8 + PNG 0.02 (a smooth picture) to 0.10 s (noise). oneDNN's f32 loses to
XLA's at these shapes; int8 takes a third off both networks; the host's part is small beside them.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_int8 import cpu_line  # noqa: E402
from picture import OPENCLIP_H  # noqa: E402


def variants(module, component: str) -> dict:
    """name -> (jitted call of the module's params and input, params, oneDNN switch while tracing)."""
    from flax import nnx

    from engine.loading.quantize import quantize_params

    graph, params = nnx.split(module)
    quantized = quantize_params(nnx.State({"unet": params}), "unet", mode="w8a8")["unet"]  # its kernels' choice
    call = (lambda p, x: nnx.merge(graph, p).decoder(x)) if component == "taesd" else None
    call = call or (lambda p, x: nnx.merge(graph, p)(x).last_hidden_state)
    return {"f32": (call, params, None), "dnnl32": (call, params, "1"), "w8a8": (call, quantized, None)}


def time_networks(rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from engine.models.autoencoder_tiny import AutoencoderTiny
    from engine.models.clip import CLIPTextModel
    from engine.models.config import AutoencoderTinyConfig, CLIPTextConfig
    from engine.nn import int8, onednn

    nets = {
        "text encoder": (CLIPTextModel(CLIPTextConfig(**OPENCLIP_H), nnx.Rngs(0)), "text"),
        "TAESD decode": (AutoencoderTiny(AutoencoderTinyConfig(), nnx.Rngs(1)), "taesd"),
    }
    inputs = {
        "text encoder": jnp.asarray(np.random.default_rng(0).integers(0, 49408, (1, 77)), jnp.int32),
        "TAESD decode": jax.random.normal(jax.random.key(0), (1, 64, 64, 4)),
    }
    jobs, pins = {}, []
    for net, (module, component) in nets.items():
        for name, (call, params, switch) in variants(module, component).items():
            if switch == "1" and not onednn.registered():
                continue  # no kernels here: nothing to compare
            os.environ.pop(onednn.SWITCH, None)
            if switch:
                os.environ[onednn.SWITCH] = switch  # read when the layers trace
            fn = jax.jit(call)
            if switch == "1" or name == "w8a8":
                pins.append(onednn.pin(params, (jnp.float32,) if switch == "1" else None, int8.kernel_values(params)))
            start = time.perf_counter()
            fn(params, inputs[net]).block_until_ready()
            print(f"{net} {name}: compiled and first call {time.perf_counter() - start:.1f} s", flush=True)
            jobs[net, name] = (fn, params)
    os.environ.pop(onednn.SWITCH, None)
    best, outs = dict.fromkeys(jobs, float("inf")), {}
    for _ in range(rounds):
        for (net, name), (fn, params) in jobs.items():
            start = time.perf_counter()
            outs[net, name] = np.asarray(fn(params, inputs[net]), np.float64)
            best[net, name] = min(best[net, name], time.perf_counter() - start)
    for pinned in pins:
        pinned.release()
    errors = {}
    for net, name in jobs:
        ref = outs[net, "f32"]
        errors[net, name] = np.sqrt(np.mean((outs[net, name] - ref) ** 2) / np.mean(ref**2))
    return {key: (best[key], errors[key]) for key in jobs}


def time_host(rounds: int) -> dict:
    """The engine's picture after the decode: [-1, 1] f32 -> uint8 -> PIL -> PNG bytes (web/api_common's save)."""
    import numpy as np
    from PIL import Image

    decoded = np.random.default_rng(0).uniform(-1, 1, (512, 512, 3)).astype(np.float32)
    smooth = np.repeat(np.repeat(decoded[::8, ::8], 8, 0), 8, 1)  # a picture compresses more than noise does
    best = {}
    for name, array in (("PNG, noise", decoded), ("PNG, smooth", smooth)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            pixels = np.clip(np.rint((array + 1) * 127.5), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(cpu_line())
    for (net, name), (seconds, err) in time_networks(args.rounds).items():
        print(f"{net:13s} {name:7s} {seconds:6.3f} s   RMS off f32 {err:.2%}")
    for name, seconds in time_host(args.rounds).items():
        print(f"host {name:12s} {seconds:6.3f} s")
    print(f"best of {args.rounds} rounds; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
