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
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from .config import ConfigError, UNetConfig, _FromJson, _require
from .layers import Attention, ProjectedContext, TimestepEmbedding, as_context, conv, timestep_embedding
from .sources import _WEIGHT_NAME, SourceError
from .unet import DownBlock, MidBlock, cross_attentions, number_cross_attentions, project_context
from .weights import convert, read_safetensors

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


@dataclass
class LoadedControlNet:
    name: str  # what the user asked for: a folder or a Hub id
    config: ControlNetConfig
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays in the run dtype

    def model(self) -> ControlNetModel:
        return nnx.merge(self.graphdef, jax.tree.map(jnp.asarray, self.params))


def _weight_files(folder: Path, variant: str | None) -> list[Path]:
    by_variant: dict[str | None, list[Path]] = {}
    for file in sorted(folder.iterdir()):
        match = _WEIGHT_NAME.match(file.name)
        if match and match[1] == "diffusion_pytorch_model" and not file.name.endswith(".index.json"):
            by_variant.setdefault(match["variant"], []).append(file)
    files = by_variant.get(variant) or by_variant.get(None) or next(iter(by_variant.values()), None)
    if not files:
        raise SourceError(f"{folder}: no diffusion_pytorch_model*.safetensors ControlNet weights")
    return files


def _from_hub(repo_id: str, variant: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    hint = f"cannot fetch the ControlNet {repo_id!r} from the Hugging Face Hub and it is not in the local cache"
    try:
        files = huggingface_hub.list_repo_files(repo_id)
    except (OfflineModeIsEnabled, OSError, HfHubHTTPError) as err:
        try:
            return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
        except Exception as cache_err:
            raise SourceError(f"{hint} ({type(err).__name__}: {err})") from cache_err
    by_variant: dict[str | None, list[str]] = {}
    for f in files:
        match = _WEIGHT_NAME.match(f)  # top-level files only: a name with a "/" never matches
        if match and match[1] == "diffusion_pytorch_model":
            by_variant.setdefault(match["variant"], []).append(f)
    chosen = by_variant.get(variant) or by_variant.get(None) or next(iter(by_variant.values()), [])
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=["config.json", *chosen]))
    except (OSError, HfHubHTTPError) as err:
        raise SourceError(f"{hint} ({type(err).__name__}: {err})") from err


def load_controlnet(source: str | Path, dtype: str = "float32") -> LoadedControlNet:
    """A diffusers-format ControlNet folder (config.json + diffusion_pytorch_model*.safetensors), a pipeline
    folder's `controlnet/` sub-folder, or a Hub id; every tensor must fit (missing ones are named)."""
    variant = "fp16" if dtype in ("float16", "bfloat16") else None
    if Path(source).expanduser().is_dir():
        root = Path(source).expanduser()
    elif isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        root = _from_hub(source, variant)
    else:
        raise SourceError(f"ControlNet source {str(source)!r} is neither a folder nor a Hub id like 'owner/name'")
    if not (root / "config.json").is_file() and (root / "controlnet" / "config.json").is_file():
        root = root / "controlnet"
    if not (root / "config.json").is_file():
        raise SourceError(f"{source}: no config.json, so this is not a diffusers-format ControlNet folder")
    cfg = ControlNetConfig.from_json(root / "config.json")
    tensors = read_safetensors(_weight_files(root, variant))
    graphdef, params = convert(lambda: ControlNetModel(cfg, nnx.Rngs(0)), tensors, dtype, where=str(source))
    return LoadedControlNet(name=str(source), config=cfg, graphdef=graphdef, params=params)


def control_image_array(image: Image.Image, height: int, width: int) -> np.ndarray:
    """A control picture as the pipeline feeds it: resized (Lanczos) to [1, height, width, 3] RGB floats in [0, 1].

    Mirrors `VaeImageProcessor(do_convert_rgb=True, do_normalize=False).preprocess(image, height, width)`.
    """
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.Resampling.LANCZOS)
    return (np.asarray(image.convert("RGB"), np.float32) / 255.0)[None]


def canny_image(image: Image.Image, low: int = 100, high: int = 200) -> Image.Image:
    """The Canny edge map (OpenCV; hysteresis thresholds `low`, `high` on 0..255) as a 3-channel picture,
    white edges on black, as diffusers' ControlNet examples make it."""
    import cv2

    edges = cv2.Canny(np.asarray(image.convert("RGB")), low, high)  # [H, W] uint8, 0 or 255
    return Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2))


# The UNet fields that a ControlNet's residuals must agree with, one per skip connection and the mid block.
MATCHING_FIELDS = (
    "in_channels",
    "block_out_channels",
    "layers_per_block",
    "down_block_types",
    "cross_attention_dim",
    "addition_embed_type",
)


def attach_controlnet(model, controlnet: LoadedControlNet):
    """`model` (a `loading.LoadedModel`) with the ControlNet as `Models.controlnet`, in its one param tree:
    replicated, merged and split with the rest. Refuses a ControlNet made for another UNet layout, by field."""
    ours, theirs = model.unet_config, controlnet.config.unet

    def value(cfg: UNetConfig, name: str):
        return cfg.per_block(name) if name in ("cross_attention_dim", "layers_per_block") else getattr(cfg, name)

    wrong = [
        f"{name} {value(theirs, name)!r} (the UNet's: {value(ours, name)!r})"
        for name in MATCHING_FIELDS
        if value(theirs, name) != value(ours, name)
    ]
    if wrong:
        raise SourceError(
            f"ControlNet {controlnet.name} does not fit the model {model.name}: {'; '.join(wrong)}. "
            "Is it a ControlNet for another model family (SD 1.x, SD 2.x, SDXL)?"
        )
    models = nnx.merge(model.graphdef, model.params)  # host arrays stay host arrays
    models.controlnet = nnx.data(nnx.merge(controlnet.graphdef, controlnet.params))  # None until now: static
    graphdef, params = nnx.split(models)
    return dataclasses.replace(model, graphdef=graphdef, params=params, controlnet=controlnet.name)
