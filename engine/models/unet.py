"""The denoising UNet, mirroring diffusers' `UNet2DConditionModel` (SD 1.x, 2.x and XL layouts).

Input and output are NHWC latents; `encoder_hidden_states` is the text encoder's
[batch, tokens, cross_attention_dim], or the same already projected to every cross-attention's keys and
values (`project_context`), as a server holds it for the steps of a request. SDXL's `text_time` conditioning adds
`add_embedding(concat(pooled_text, sinusoid(time_ids)))` to the time embedding; a guidance-distilled UNet
(`time_cond_proj_dim`, LCM) adds its projection of the guidance scale's embedding (`timestep_cond`) to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn.layers import (
    Attention,
    Context,
    Downsample2D,
    ProjectedContext,
    ResnetBlock2D,
    TimestepEmbedding,
    Transformer2DModel,
    Upsample2D,
    as_context,
    conv,
    group_norm,
    timestep_embedding,
)
from .config import UNetConfig


def cross_attentions(blocks: list) -> list[Attention]:
    """Every cross-attention to the text in `blocks` (down, mid, up; None skipped), in the order they run."""
    spatial = [t for block in blocks if block is not None for t in (block.attentions or [])]
    return [b.attn2 for t in spatial for b in t.transformer_blocks]


def number_cross_attentions(blocks: list) -> None:
    """Gives each cross-attention its place in the network's ProjectedContext."""
    for index, attn in enumerate(cross_attentions(blocks)):
        attn.kv_index = index


def project_context(blocks: list, encoder_hidden_states: jax.Array, dtype) -> ProjectedContext:
    """The text's keys and values for every cross-attention in `blocks`: what the network takes in its place."""
    context = encoder_hidden_states.astype(dtype)
    return ProjectedContext(tuple(attn.project(context) for attn in cross_attentions(blocks)))


def transformers(cfg: UNetConfig, ch: int, heads: int, cross: int, depth: int, count: int, rngs: nnx.Rngs) -> nnx.List:
    """The `attentions` of a cross-attention block: one spatial transformer per resnet."""
    return nnx.List(
        [
            Transformer2DModel(ch, heads, cross, depth, cfg.use_linear_projection, cfg.norm_num_groups, rngs)
            for _ in range(count)
        ]
    )


class DownBlock(nnx.Module):
    """`DownBlock2D` (resnets only) or `CrossAttnDownBlock2D` (a transformer after each resnet)."""

    def __init__(self, cfg: UNetConfig, index: int, in_ch: int, rngs: nnx.Rngs):
        out_ch = cfg.block_out_channels[index]
        layers = cfg.per_block("layers_per_block")[index]
        groups, eps, temb = cfg.norm_num_groups, cfg.norm_eps, cfg.time_embed_dim
        self.resnets = nnx.List(
            [ResnetBlock2D(in_ch if j == 0 else out_ch, out_ch, temb, groups, eps, rngs) for j in range(layers)]
        )
        self.attentions = (
            transformers(
                cfg,
                out_ch,
                cfg.heads_per_block[index],
                cfg.per_block("cross_attention_dim")[index],
                cfg.per_block("transformer_layers_per_block")[index],
                layers,
                rngs,
            )
            if cfg.down_block_types[index] == "CrossAttnDownBlock2D"
            else None
        )
        is_final = index == cfg.num_blocks - 1
        self.downsamplers = None if is_final else nnx.List([Downsample2D(out_ch, cfg.downsample_padding, rngs)])

    def __call__(
        self, x: jax.Array, temb: jax.Array, context: Context, downsample: bool = True
    ) -> tuple[jax.Array, list[jax.Array]]:
        """x -> (x, the skip connections it leaves); `downsample` False stops before the downsampler."""
        skips = []
        for j, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context)
            skips.append(x)
        if self.downsamplers is not None and downsample:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class UpBlock(nnx.Module):
    """`UpBlock2D` or `CrossAttnUpBlock2D`: each resnet first concatenates one skip connection."""

    def __init__(self, cfg: UNetConfig, index: int, prev_ch: int, rngs: nnx.Rngs):
        rev = lambda name: tuple(reversed(cfg.per_block(name)))  # noqa: E731
        channels = tuple(reversed(cfg.block_out_channels))
        out_ch = channels[index]
        in_ch = channels[min(index + 1, cfg.num_blocks - 1)]
        layers = rev("layers_per_block")[index] + 1
        depth = (cfg.reverse_transformer_layers_per_block or rev("transformer_layers_per_block"))[index]
        groups, eps, temb = cfg.norm_num_groups, cfg.norm_eps, cfg.time_embed_dim
        resnets = []
        for j in range(layers):
            skip_ch = in_ch if j == layers - 1 else out_ch
            res_in = prev_ch if j == 0 else out_ch
            resnets.append(ResnetBlock2D(res_in + skip_ch, out_ch, temb, groups, eps, rngs))
        self.resnets = nnx.List(resnets)
        heads, cross = tuple(reversed(cfg.heads_per_block))[index], rev("cross_attention_dim")[index]
        self.attentions = (
            transformers(cfg, out_ch, heads, cross, depth, layers, rngs)
            if cfg.up_block_types[index] == "CrossAttnUpBlock2D"
            else None
        )
        is_final = index == cfg.num_blocks - 1
        self.upsamplers = None if is_final else nnx.List([Upsample2D(out_ch, rngs)])

    def __call__(self, x: jax.Array, skips: list[jax.Array], temb: jax.Array, context: Context) -> jax.Array:
        for j, resnet in enumerate(self.resnets):
            x = jnp.concatenate([x, skips.pop()], axis=-1)  # [batch, h, w, channels + skip_channels]
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, skips[-1].shape[1:3])  # the next block's skip sets the size
        return x


class MidBlock(nnx.Module):
    """`UNetMidBlock2DCrossAttn`: resnet, then (transformer, resnet) pairs."""

    def __init__(self, cfg: UNetConfig, rngs: nnx.Rngs):
        ch = cfg.block_out_channels[-1]
        groups, eps, temb = cfg.norm_num_groups, cfg.norm_eps, cfg.time_embed_dim
        scale = cfg.mid_block_scale_factor
        self.resnets = nnx.List([ResnetBlock2D(ch, ch, temb, groups, eps, rngs, scale) for _ in range(2)])
        self.attentions = transformers(
            cfg,
            ch,
            cfg.heads_per_block[-1],
            cfg.per_block("cross_attention_dim")[-1],
            cfg.per_block("transformer_layers_per_block")[-1],
            1,
            rngs,
        )

    def __call__(self, x: jax.Array, temb: jax.Array, context: Context) -> jax.Array:
        x = self.resnets[0](x, temb)
        return self.resnets[1](self.attentions[0](x, context), temb)


class UNet2DConditionModel(nnx.Module):
    def __init__(self, cfg: UNetConfig, rngs: nnx.Rngs):
        self.config = cfg
        ch0 = cfg.block_out_channels[0]
        self.conv_in = conv(cfg.in_channels, ch0, 3, rngs)
        self.time_embedding = TimestepEmbedding(ch0, cfg.time_embed_dim, rngs, cfg.time_cond_proj_dim)
        self.add_embedding = (
            TimestepEmbedding(cfg.projection_class_embeddings_input_dim, cfg.time_embed_dim, rngs)
            if cfg.addition_embed_type == "text_time"
            else None
        )
        blocks, ch = [], ch0
        for i in range(cfg.num_blocks):
            blocks.append(DownBlock(cfg, i, ch, rngs))
            ch = cfg.block_out_channels[i]
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(cfg, rngs) if cfg.mid_block_type else None
        blocks, prev = [], cfg.block_out_channels[-1]
        for i in range(cfg.num_blocks):
            blocks.append(UpBlock(cfg, i, prev, rngs))
            prev = tuple(reversed(cfg.block_out_channels))[i]
        self.up_blocks = nnx.List(blocks)
        self.conv_norm_out = group_norm(ch0, cfg.norm_num_groups, cfg.norm_eps, rngs)
        self.conv_out = conv(ch0, cfg.out_channels, 3, rngs)
        number_cross_attentions(self._blocks())

    def _blocks(self) -> list:
        return [*self.down_blocks, self.mid_block, *self.up_blocks]

    def cross_attentions(self) -> list[Attention]:
        """Every cross-attention to the text, in the order a forward pass runs them."""
        return cross_attentions(self._blocks())

    def project_context(self, encoder_hidden_states: jax.Array) -> ProjectedContext:
        """The text's keys and values for every cross-attention: what `__call__` takes in its place."""
        return project_context(self._blocks(), encoder_hidden_states, self.conv_in.kernel.dtype)

    def _embed(self, sample, timesteps, text_embeds, time_ids, timestep_cond) -> tuple[jax.Array, jax.Array]:
        """(the time embedding every resnet reads, conv_in's output)."""
        cfg = self.config
        dtype = self.conv_in.kernel.dtype
        timesteps = jnp.broadcast_to(timesteps, (sample.shape[0],))
        t_emb = timestep_embedding(timesteps, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        cond = None if timestep_cond is None or self.time_embedding.cond_proj is None else timestep_cond.astype(dtype)
        temb = self.time_embedding(t_emb.astype(dtype), cond)
        if self.add_embedding is not None:
            b = time_ids.shape[0]
            time_emb = timestep_embedding(
                time_ids.reshape(-1), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos, cfg.freq_shift
            )
            time_emb = time_emb.reshape(b, -1)  # [batch, time_ids * addition_time_embed_dim]
            added = jnp.concatenate([text_embeds.astype(jnp.float32), time_emb], axis=-1)
            temb = temb + self.add_embedding(added.astype(dtype))
        x = sample.astype(dtype)
        if cfg.center_input_sample:
            x = 2 * x - 1.0
        return temb, self.conv_in(x)

    def __call__(
        self,
        sample: jax.Array,
        timesteps: jax.Array,
        encoder_hidden_states: jax.Array | ProjectedContext,
        text_embeds: jax.Array | None = None,
        time_ids: jax.Array | None = None,
        down_block_additional_residuals: tuple[jax.Array, ...] | None = None,
        mid_block_additional_residual: jax.Array | None = None,
        timestep_cond: jax.Array | None = None,
        keep_deep: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """sample [batch, h, w, in_channels]; timesteps [batch] or scalar; returns [batch, h, w, out_channels].

        The additional residuals are a ControlNet's (`engine.models.controlnet`): one per skip connection, added to
        the skips, and one added to the mid block's output, as diffusers' UNet does. `timestep_cond`
        [batch, time_cond_proj_dim]: what a UNet with `time_cond_proj_dim` adds to its timestep embedding (LCM's
        guidance scale embedding, `nn.layers.guidance_scale_embedding`); without it that input is skipped.
        `keep_deep`: also return the deep features, what the last up block reads besides the first level's skips,
        for `shallow` to reuse at the next steps (DeepCache).
        """
        temb, x = self._embed(sample, timesteps, text_embeds, time_ids, timestep_cond)
        context = as_context(encoder_hidden_states, self.conv_in.kernel.dtype)
        skips = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, temb, context)
            skips.extend(block_skips)
        if down_block_additional_residuals is not None:
            skips = [s + r.astype(s.dtype) for s, r in zip(skips, down_block_additional_residuals, strict=True)]
        if self.mid_block is not None:
            x = self.mid_block(x, temb, context)
        if mid_block_additional_residual is not None:
            x = x + mid_block_additional_residual.astype(x.dtype)
        for block in self.up_blocks[:-1]:
            x = block(x, skips, temb, context)
        deep = x
        x = self.up_blocks[-1](x, skips, temb, context)
        x = self.conv_out(self.conv_norm_out(x, silu=True))
        return (x, deep) if keep_deep else x

    def shallow(
        self,
        sample: jax.Array,
        timesteps: jax.Array,
        encoder_hidden_states: jax.Array | ProjectedContext,
        deep: jax.Array,
        text_embeds: jax.Array | None = None,
        time_ids: jax.Array | None = None,
        timestep_cond: jax.Array | None = None,
    ) -> jax.Array:
        """The noise prediction from the first level only, with `deep` (`__call__(keep_deep=True)` at an earlier
        step) standing for everything below it, as DeepCache (Ma et al., 2023) reuses the slowly changing deep
        features between adjacent steps: conv_in, the first down block up to its downsampler, the last up block."""
        temb, x = self._embed(sample, timesteps, text_embeds, time_ids, timestep_cond)
        context = as_context(encoder_hidden_states, self.conv_in.kernel.dtype)
        _, block_skips = self.down_blocks[0](x, temb, context, downsample=False)
        x = self.up_blocks[-1](deep.astype(x.dtype), [x, *block_skips], temb, context)
        return self.conv_out(self.conv_norm_out(x, silu=True))

    def merge_tokens(self, ratio: float) -> None:
        """Token merging (`nn.token_merging`) at `ratio` before the first level's self-attentions, as tomesd's
        defaults (`max_downsample` 1): set on this copy of the network, a traced one for one program."""
        for block in (self.down_blocks[0], self.up_blocks[-1]):
            for transformer in block.attentions or []:
                for layer in transformer.transformer_blocks:
                    layer.merge_ratio = ratio

    def deep_shape(self, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        """The deep features' shape for a [batch, height, width, c] sample: the last up block's input."""
        return (batch, height, width, self.config.block_out_channels[min(1, self.config.num_blocks - 1)])
