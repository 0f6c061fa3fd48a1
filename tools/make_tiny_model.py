"""Writes a small random-weight Stable Diffusion folder in diffusers layout, using our own models.

    python tools/make_tiny_model.py engine/assets/default

The folder loads in `engine.load_pipeline` and in diffusers' `StableDiffusionPipeline`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.loading.weights import export  # noqa: E402
from engine.models.clip import CLIPTextModel  # noqa: E402
from engine.models.config import CLIPTextConfig, UNetConfig, VAEConfig  # noqa: E402
from engine.models.unet import UNet2DConditionModel  # noqa: E402
from engine.models.vae import AutoencoderKL  # noqa: E402
from tools.shapes import WORDS  # noqa: E402
from tools.tiny_tokenizer import write_tokenizer  # noqa: E402

UNET = UNetConfig(
    sample_size=8,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=64,
    attention_head_dim=4,
    norm_num_groups=8,
)
VAE = VAEConfig(
    block_out_channels=(8, 16, 32, 32),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=1,
    layers_per_block=1,
    sample_size=64,
)
# SD 1.x's noise schedule; DDIM is the default sampler of the shipped model (diffusers loads it too).
SCHEDULER = {
    "_class_name": "DDIMScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
    "trained_betas": None,
    # Read only when a user picks PNDM: its plain PLMS form, which is the one the engine runs.
    "skip_prk_steps": True,
}


def clip_config(vocab_size: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        projection_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        eos_token_id=vocab_size - 1,
    )


def write_component(folder: Path, config: dict, tensors: dict, weights_name: str, extra: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**extra, **config}, indent=2))
    save_file(tensors, str(folder / weights_name))


def write_model(
    out: Path,
    unet: UNet2DConditionModel,
    vae: AutoencoderKL,
    text_encoder: CLIPTextModel,
    scheduler: dict,
    dtype=np.float16,
    extra: dict | None = None,
) -> None:
    """Saves our models as a diffusers-format StableDiffusionPipeline folder (tokenizer written separately)."""
    out.mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": "0.30.0",
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "requires_safety_checker": False,
        "safety_checker": [None, None],
        "scheduler": ["diffusers", scheduler["_class_name"]],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2))
    meta = {"_diffusers_version": "0.30.0"}
    write_component(
        out / "unet",
        {"_class_name": "UNet2DConditionModel", **unet.config.to_dict()},
        export(unet, dtype),
        "diffusion_pytorch_model.safetensors",
        meta,
    )
    write_component(
        out / "vae",
        {"_class_name": "AutoencoderKL", **vae.config.to_dict()},
        export(vae, dtype),
        "diffusion_pytorch_model.safetensors",
        meta,
    )
    clip = text_encoder.config.to_dict()
    clip_meta = {
        "architectures": ["CLIPTextModel"],
        "model_type": "clip_text_model",
        "bos_token_id": clip["vocab_size"] - 2,
        "pad_token_id": clip["vocab_size"] - 1,
    }
    write_component(out / "text_encoder", clip, export(text_encoder, dtype), "model.safetensors", clip_meta)
    if extra:
        (out / "jax_sd.json").write_text(json.dumps(extra, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    vocab = write_tokenizer(args.out / "tokenizer", WORDS)
    rngs = nnx.Rngs(args.seed)
    write_model(
        args.out,
        UNet2DConditionModel(UNET, rngs),
        AutoencoderKL(VAE, rngs),
        CLIPTextModel(clip_config(vocab), rngs),
        SCHEDULER,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
