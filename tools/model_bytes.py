"""What each component of a model folder weighs as this project stores it, in bf16 and with `--quantize int8`,
computed from the folder's configs alone: no weights are read or drawn.

The folder's family (its model_index.json class) builds its networks as `load_pipeline` does, with shapes only
(`nn.layers.shapes_only`), and `--quantize int8` replaces the kernels it replaces at load
(`loading.quantize.int8_components`: the denoiser's and a Qwen3 text encoder's large linear kernels, one byte a weight
and a scale per output channel; embeddings, norms, biases, convolutions and the VAE as they are). So the numbers are
the params the devices hold, text encoder included (`--t5 device`); not activations, compiled programs or the host's
copy of anything.

    python -m tools.model_bytes FOLDER [FOLDER...]   # a diffusers folder: model_index.json and each config.json
    python -m tools.model_bytes --published          # Z-Image-Turbo, FLUX.2 [klein] 4B and 9B (`PUBLISHED`)

`PUBLISHED` holds those models' configs, as their Hub folders' config.json files read (the architecture's fields;
the Hub is not reachable from here, so they were read from public copies: see each entry), written to a temporary
folder and measured as any other. GB is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from engine.families.base import Models
from engine.families.loader import folder_family
from engine.loading.quantize import int8_components, param_bytes, quantize_params, streaming_int8
from engine.loading.sources import resolve
from engine.nn.layers import shapes_only

# Qwen/Qwen3-4B config.json (36 layers of 2560, 32 query and 8 key/value heads of 128, SwiGLU 9728, tied embedding)
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# Qwen/Qwen3-8B config.json (FLUX.2 [klein] 9B's text encoder): 4096 wide, SwiGLU 12288, its own lm_head (not read)
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
# FLUX.1's VAE (Z-Image's vae/config.json): 16 latent channels, no quant convolutions
FLUX1_VAE = {
    "_class_name": "AutoencoderKL",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# FLUX.2's VAE (every [klein] folder's vae/config.json): 32 latent channels, quant convolutions, a batch norm
FLUX2_VAE = {
    "_class_name": "AutoencoderKLFlux2",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "latent_channels": 32,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
    "use_quant_conv": True,
    "use_post_quant_conv": True,
}
# FLUX.2-klein-4B transformer/config.json as diffusers' scripts/convert_flux2_to_diffusers.py writes it (`klein-4b`)
KLEIN_4B = {
    "_class_name": "Flux2Transformer2DModel",
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 20,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": False,
}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000}
PUBLISHED = {
    # Tongyi-MAI/Z-Image-Turbo: transformer/config.json as ComfyUI's and ai-toolkit's Z-Image plugins copy it
    "Tongyi-MAI/Z-Image-Turbo": {
        "model_index.json": {"_class_name": "ZImagePipeline"},
        "transformer": {
            "_class_name": "ZImageTransformer2DModel",
            "all_patch_size": [2],
            "all_f_patch_size": [1],
            "in_channels": 16,
            "dim": 3840,
            "n_layers": 30,
            "n_refiner_layers": 2,
            "n_heads": 30,
            "n_kv_heads": 30,
            "norm_eps": 1e-5,
            "qk_norm": True,
            "cap_feat_dim": 2560,
            "rope_theta": 256.0,
            "t_scale": 1000.0,
            "axes_dims": [32, 48, 48],
            "axes_lens": [1536, 512, 512],
        },
        "text_encoder": QWEN3_4B,
        "vae": FLUX1_VAE,
        "scheduler": {**SCHEDULER, "shift": 3.0, "use_dynamic_shifting": False},
    },
    "black-forest-labs/FLUX.2-klein-4B": {
        "model_index.json": {"_class_name": "Flux2KleinPipeline", "is_distilled": True},
        "transformer": KLEIN_4B,
        "text_encoder": QWEN3_4B,
        "vae": FLUX2_VAE,
        "scheduler": {**SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True},
    },
    # 9B: 8 double and 24 single blocks of 32 heads, reading Qwen3-8B's layers (3 x 4096 wide)
    "black-forest-labs/FLUX.2-klein-9B": {
        "model_index.json": {"_class_name": "Flux2KleinPipeline", "is_distilled": True},
        "transformer": {
            **KLEIN_4B,
            "num_layers": 8,
            "num_single_layers": 24,
            "num_attention_heads": 32,
            "joint_attention_dim": 12288,
        },
        "text_encoder": QWEN3_8B,
        "vae": FLUX2_VAE,
        "scheduler": {**SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True},
    },
}
FREE_SPACE = 16e9  # a free Hugging Face Space: 16 GB of memory (2 vCPUs), weights and everything else in it
LOADING_THREADS = 2  # `loading.weights.LOAD_THREADS` there: its 2 vCPUs


def _shapes(source: str | Path, dtype: str) -> tuple[nnx.State, list[str]]:
    """The folder's networks as shape-only params in `dtype`, and the components `--quantize int8` takes."""
    folder = resolve(source)
    family = folder_family(folder)
    configs = {
        name: cls.from_json(folder.component(name) / "config.json")
        for name, cls in family.configs.items()
        if name not in family.optional or folder.has(name)
    }
    with shapes_only():
        _, params = nnx.split(Models(**family.build(configs, nnx.Rngs(0))))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), params)
    chosen = [name for name in int8_components(family.denoiser.component, family.configs, "int8") if name in params]
    return params, chosen


def component_bytes(source: str | Path, dtype: str = "bfloat16") -> dict[str, tuple[int, int]]:
    """component -> (bytes in `dtype`, bytes with `--quantize int8`) of the folder's networks as `load_pipeline`
    builds them (text encoder on the devices), from its configs alone."""
    params, chosen = _shapes(source, dtype)
    quantized = quantize_params(params, chosen)
    return {name: (param_bytes(params[name]), param_bytes(quantized[name])) for name in sorted(params.keys())}


def kernels_in_flight(source: str | Path, threads: int = LOADING_THREADS, dtype: str = "bfloat16") -> int:
    """Bytes a `--quantize int8` load holds at most beside the finished int8 tree (`loading.weights.convert(int8=)`
    quantizes each kernel as it reads it): `threads` of the largest kernels it quantizes at once, each as its copy in
    `dtype`, `quantize_kernel`'s f32 copy, and its int8 values twice (as made, then aligned for the devices)."""
    params, chosen = _shapes(source, dtype)
    takes = streaming_int8(chosen)
    largest = max(
        (math.prod(var.get_value().shape) for path, var in nnx.to_flat_state(params) if takes(path, var.get_value())),
        default=0,
    )
    return threads * largest * (jnp.dtype(dtype).itemsize + 4 + 2)


def write_folder(root: Path, files: dict) -> Path:
    """A folder of configs only: model_index.json and each component's config.json (the scheduler's by its name)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if name == "model_index.json":
            path = root / name
        else:
            path = root / name / ("scheduler_config.json" if name == "scheduler" else "config.json")
            path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(content))
    return root


def report(name: str, sizes: dict[str, tuple[int, int]], in_flight: int = 0) -> str:
    """A table of the components, with what a 16 GB free Space keeps for everything else once the int8 weights are
    in, and the peak while loading with int8: the int8 tree and the kernels being quantized (`kernels_in_flight`)."""
    rows = [f"{name}", f"  {'component':<14}{'bf16 GB':>9}{'int8 GB':>9}"]
    rows += [f"  {c:<14}{b / 1e9:>9.2f}{q / 1e9:>9.2f}" for c, (b, q) in sizes.items()]
    bf16, int8 = (sum(s[i] for s in sizes.values()) for i in (0, 1))
    rows.append(f"  {'total':<14}{bf16 / 1e9:>9.2f}{int8 / 1e9:>9.2f}")
    rows.append(
        f"  computed, not measured: with int8, {(FREE_SPACE - int8) / 1e9:.2f} GB of a 16 GB free Space left for "
        f"activations and the runtime; {(int8 + in_flight) / 1e9:.2f} GB held at most while loading "
        f"({LOADING_THREADS} loading threads)"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", help="diffusers-format folders (their configs are all that is read)")
    parser.add_argument("--published", action="store_true", help="Z-Image-Turbo and FLUX.2 [klein] 4B and 9B")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {str(f): f for f in args.folders}
        if args.published:
            sources.update({n: write_folder(Path(tmp) / n.replace("/", "--"), c) for n, c in PUBLISHED.items()})
        for name, source in sources.items():
            print(report(name, component_bytes(source), kernels_in_flight(source)))


if __name__ == "__main__":
    main()
