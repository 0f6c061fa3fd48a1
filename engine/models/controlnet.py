"""ControlNet, mirroring diffusers' `ControlNetModel` (Zhang et al. 2023, "Adding Conditional Control").

A trainable copy of the UNet's encoder half (`conv_in`, `time_embedding`, `down_blocks`, `mid_block`,
built from the UNet's own block classes) sees the latents plus an embedded control image, and each of
its skip connections and its mid-block output passes through a zero-initialised 1x1 conv
(`controlnet_down_blocks`, `controlnet_mid_block`). The UNet adds these residuals to its own skips and
mid-block output (`UNet2DConditionModel.__call__(..., down_block_additional_residuals=,
mid_block_additional_residual=)`). NHWC throughout; the control image is RGB in [0, 1] at pixel size,
as `StableDiffusionControlNetPipeline` feeds it (`control_image_array`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import ConfigError
from ..nn.layers import Attention, ProjectedContext, TimestepEmbedding, as_context, conv, timestep_embedding
from .config import UNetConfig, _FromJson, _require
from .unet import DownBlock, MidBlock, cross_attentions, number_cross_attentions, project_context

UP_BLOCK_OF = {"CrossAttnDownBlock2D": "CrossAttnUpBlock2D", "DownBlock2D": "UpBlock2D"}


@dataclass(frozen=True)
class ControlNetConfig(_FromJson):
    """`ControlNetModel` config (the ControlNet folder's config.json); the UNet fields mean what they do there."""

    in_channels: int = 4
    conditioning_channels: int = 3  # channels of the control image
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    # Misnomer kept from diffusers, as in UNetConfig: the number of heads unless num_attention_heads is set.
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool = False
    resnet_time_scale_shift: str = "default"
    projection_class_embeddings_input_dim: int | None = None
    controlnet_conditioning_channel_order: str = "rgb"  # "bgr": the model was trained on BGR control images
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)  # each step after the first halves
    global_pool_conditions: bool = False  # residuals averaged over the image (the "shuffle" ControlNets)
    addition_embed_type_num_heads: int = 64

    @property
    def unet(self) -> UNetConfig:
        """The encoder half of a UNet with this layout: what the shared down and mid blocks are built from."""
        shared = {f.name for f in dataclasses.fields(UNetConfig)} & {f.name for f in dataclasses.fields(self)}
        fields = {name: getattr(self, name) for name in shared}
        fields["up_block_types"] = tuple(UP_BLOCK_OF.get(t, t) for t in reversed(self.down_block_types))
        return UNetConfig.from_dict(fields, where="ControlNet config")

    @property
    def cond_downscale(self) -> int:
        """Pixels per latent that the control image embedding assumes (8 for every published ControlNet)."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

    def validate(self, where: str) -> None:
        _require(
            self.controlnet_conditioning_channel_order in ("rgb", "bgr"),
            where,
            f"controlnet_conditioning_channel_order {self.controlnet_conditioning_channel_order!r} is not rgb or bgr",
        )
        _require(
            self.mid_block_type == "UNetMidBlock2DCrossAttn",
            where,
            f"mid_block_type {self.mid_block_type!r} is not supported (only 'UNetMidBlock2DCrossAttn')",
        )
        try:
            self.unet  # noqa: B018 (validates the shared UNet fields)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err


class ControlNetConditioningEmbedding(nnx.Module):
    """Control image [batch, H, W, 3] -> [batch, H/8, W/8, block_out_channels[0]]: convs with SiLU, stride 2 thrice."""

    def __init__(self, cfg: ControlNetConfig, rngs: nnx.Rngs):
        chans = cfg.conditioning_embedding_out_channels
        self.conv_in = conv(cfg.conditioning_channels, chans[0], 3, rngs)
        blocks = []
        for c_in, c_out in zip(chans[:-1], chans[1:], strict=True):
            blocks += [conv(c_in, c_in, 3, rngs), conv(c_in, c_out, 3, rngs, stride=2)]
        self.blocks = nnx.List(blocks)
        self.conv_out = conv(chans[-1], cfg.block_out_channels[0], 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.silu(self.conv_in(x))
        for block in self.blocks:
            x = jax.nn.silu(block(x))
        return self.conv_out(x)


class ControlNetModel(nnx.Module):
    def __init__(self, cfg: ControlNetConfig, rngs: nnx.Rngs):
        self.config = cfg
        ucfg = cfg.unet
        ch0 = cfg.block_out_channels[0]
        self.conv_in = conv(cfg.in_channels, ch0, 3, rngs)
        self.time_embedding = TimestepEmbedding(ch0, ucfg.time_embed_dim, rngs)
        self.add_embedding = (
            TimestepEmbedding(cfg.projection_class_embeddings_input_dim, ucfg.time_embed_dim, rngs)
            if cfg.addition_embed_type == "text_time"
            else None
        )
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(cfg, rngs)
        # One zero-initialised 1x1 conv per UNet skip connection: conv_in's, each resnet's, each downsampler's.
        blocks, heads, ch = [], [conv(ch0, ch0, 1, rngs)], ch0
        for i in range(ucfg.num_blocks):
            blocks.append(DownBlock(ucfg, i, ch, rngs))
            ch = cfg.block_out_channels[i]
            skips = cfg.layers_per_block + (i < ucfg.num_blocks - 1)
            heads += [conv(ch, ch, 1, rngs) for _ in range(skips)]
        self.down_blocks = nnx.List(blocks)
        self.controlnet_down_blocks = nnx.List(heads)
        self.mid_block = MidBlock(ucfg, rngs)
        self.controlnet_mid_block = conv(ch, ch, 1, rngs)
        number_cross_attentions(self._blocks())

    def _blocks(self) -> list:
        return [*self.down_blocks, self.mid_block]

    def cross_attentions(self) -> list[Attention]:
        """Every cross-attention to the text, in the order a forward pass runs them."""
        return cross_attentions(self._blocks())

    def project_context(self, encoder_hidden_states: jax.Array) -> ProjectedContext:
        """The text's keys and values for every cross-attention: what `__call__` takes in its place."""
        return project_context(self._blocks(), encoder_hidden_states, self.conv_in.kernel.dtype)

    def __call__(
        self,
        sample: jax.Array,
        timesteps: jax.Array,
        encoder_hidden_states: jax.Array | ProjectedContext,
        controlnet_cond: jax.Array,
        conditioning_scale: float | jax.Array = 1.0,
        text_embeds: jax.Array | None = None,
        time_ids: jax.Array | None = None,
        guess_mode: bool = False,
    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """The residuals for `UNet2DConditionModel`, each multiplied by the conditioning scale.

        sample [batch, h, w, in_channels] (the UNet's input); controlnet_cond [batch, h * 8, w * 8, 3] in [0, 1];
        conditioning_scale a scalar or one per image [batch] (traced: a new value never recompiles).
        Returns (down residuals, one per UNet skip connection, [batch, h_k, w_k, channels_k]; mid residual).
        `guess_mode` (static) ramps the scales from 0.1 (first skip) to 1 (mid block), as diffusers does.
        """
        cfg = self.config
        dtype = self.conv_in.kernel.dtype
        batch = sample.shape[0]
        timesteps = jnp.broadcast_to(timesteps, (batch,))
        t_emb = timestep_embedding(timesteps, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        temb = self.time_embedding(t_emb.astype(dtype))
        if self.add_embedding is not None:
            time_emb = timestep_embedding(
                time_ids.reshape(-1), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos, cfg.freq_shift
            ).reshape(time_ids.shape[0], -1)  # [batch, time_ids * addition_time_embed_dim]
            added = jnp.concatenate([text_embeds.astype(jnp.float32), time_emb], axis=-1)
            temb = temb + self.add_embedding(added.astype(dtype))
        context = as_context(encoder_hidden_states, dtype)
        cond = controlnet_cond.astype(dtype)
        if cfg.controlnet_conditioning_channel_order == "bgr":
            cond = cond[..., ::-1]
        x = self.conv_in(sample.astype(dtype)) + self.controlnet_cond_embedding(cond)
        skips = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, temb, context)
            skips.extend(block_skips)
        x = self.mid_block(x, temb, context)
        down = [head(skip) for head, skip in zip(self.controlnet_down_blocks, skips, strict=True)]
        mid = self.controlnet_mid_block(x)

        scale = jnp.asarray(conditioning_scale, jnp.float32)
        scale = scale.reshape(-1, 1, 1, 1) if scale.ndim == 1 else scale  # one per image: [batch, 1, 1, 1]
        ramp = np.logspace(-1, 0, len(down) + 1) if guess_mode else np.ones(len(down) + 1)
        down = [(r * (scale * s)).astype(dtype) for r, s in zip(down, ramp[:-1], strict=True)]
        mid = (mid * (scale * ramp[-1])).astype(dtype)
        if cfg.global_pool_conditions:
            down = [r.mean(axis=(1, 2), keepdims=True) for r in down]
            mid = mid.mean(axis=(1, 2), keepdims=True)
        return tuple(down), mid
