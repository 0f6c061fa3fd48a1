"""The PyTorch reference side of the parity tests: tiny random diffusers/transformers models.

Every parameter is redrawn from a seeded normal so that no weight is left at a zero init
that would hide a wrong mapping.
"""

from __future__ import annotations

import numpy as np
import torch

torch.set_num_threads(1)  # JAX holds the other core; oversubscribed threads slow torch tenfold

# Tiny UNet layouts that exercise what SD 1.x, 2.x and XL use.
UNET_LAYOUTS = {
    "sd1": dict(
        block_out_channels=(32, 64),
        layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=8,
        sample_size=16,
    ),
    "sd2": dict(
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=48,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        upcast_attention=True,
        norm_num_groups=8,
        sample_size=16,
    ),
    "sdxl": dict(
        block_out_channels=(32, 64),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
        norm_num_groups=8,
        sample_size=16,
    ),
}

# Tiny twins of the published small distilled UNets (`PUBLISHED_DISTILLED_UNETS` in test_models.py): the same
# block types, layers per block, mid block and attention style, with small channels.
_FOUR = dict(
    block_out_channels=(16, 16, 32, 32),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1,
    cross_attention_dim=24,
    attention_head_dim=2,
    norm_num_groups=8,
    sample_size=16,
)
_THREE = dict(
    _FOUR,
    block_out_channels=(16, 16, 32),
    down_block_types=("CrossAttnDownBlock2D",) * 3,
    up_block_types=("CrossAttnUpBlock2D",) * 3,
    mid_block_type=None,
)
DISTILLED_UNET_LAYOUTS = {
    # BK-SDM-Base (nota-ai/bk-sdm-base, -v2-base) and segmind/small-sd: one resnet (and transformer) per down
    # block, two per up block, the mid block kept.
    "bk-sdm-base": _FOUR,
    # BK-SDM-Small (nota-ai/bk-sdm-small): the same without the mid block.
    "bk-sdm-small": dict(_FOUR, mid_block_type=None),
    # BK-SDM-Tiny (nota-ai/bk-sdm-tiny) and segmind/tiny-sd: also without the innermost, attention-free stage.
    "bk-sdm-tiny": _THREE,
    # SDXS-512-DreamShaper (IDKiro/sdxs-512-dreamshaper): BK-SDM-Tiny's depth with SDXL's placement of attention,
    # none in the outermost stage.
    "sdxs-512-dreamshaper": dict(
        _THREE,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    ),
    # SDXS-512-0.9 (IDKiro/sdxs-512-0.9): the tiny UNet of SD 2.1-base, linear projections and per-block heads.
    "sdxs-512-0.9": dict(_THREE, use_linear_projection=True, attention_head_dim=(1, 2, 4), cross_attention_dim=32),
}

VAE_LAYOUT = dict(
    block_out_channels=(16, 32),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    latent_channels=4,
    norm_num_groups=8,
    layers_per_block=1,
    sample_size=32,
)

CLIP_LAYOUTS = {
    "sd1": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, hidden_act="quick_gelu"
    ),
    "sd2": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, hidden_act="gelu"),
}
CLIP_COMMON = dict(
    vocab_size=1000, max_position_embeddings=77, projection_dim=32, bos_token_id=998, eos_token_id=999, pad_token_id=999
)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("weight") and p.ndim == 1 else 0.0  # norm scales around one
            if base == 0.0 and p.numel() >= 16:
                # In place, the same values to the bit as below (16 values and up take torch's vectorised draw in
                # both, and with mean 0 scaling by std is one rounding in both) without three temporaries of the
                # tensor's size: at real widths (FLUX.1's blocks, 546M parameters) 8-10 s of a core become 5.
                p.normal_(0.0, std, generator=gen)
            else:  # a norm's scales, a short bias: the sum below rounds otherwise than normal_'s
                p.copy_(base + std * torch.randn(p.shape, generator=gen))
    return model.eval()


def randomized(cls: type[torch.nn.Module], seed: int = 0, std: float = 0.1, **config) -> torch.nn.Module:
    """`randomize(cls(**config), seed, std)`, the same weights, without the module's own initialisation, which
    `randomize` overwrites: the model is built on the meta device and given memory only for the draw. At real widths
    (a block of each kind of FLUX.1, 546M parameters) that skips 4-5 s of a core's time."""
    with torch.device("meta"):
        model = cls(**config)
    # A buffer would be left as uninitialised memory: such a model is built as usual.
    model = model.to_empty(device="cpu") if not list(model.buffers()) else cls(**config)
    return randomize(model, seed, std)


def state_dict_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def nchw(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def nhwc(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().numpy().transpose(0, 2, 3, 1)


def rel_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / (np.abs(ref).max() + 1e-12))
