"""Trains the embedded default model on `tools.shapes`: the VAE first, then the UNet and text encoder together.

    python -m tools.train --out engine/assets/default --work runs/default
    python -m tools.train --out engine/assets/default --work runs/default --resume   # after an interruption

The models are the engine's own (`engine.models.vae`, `engine.models.unet`, `engine.models.clip`) at the shapes of
`tools/make_tiny_model.py`, trained in f32 with optax; the result is a diffusers-format folder
that `engine.load_pipeline` and diffusers' `StableDiffusionPipeline` both load.

  VAE    L1 + L2 reconstruction with a small KL term (Kingma & Welling 2014), on fresh scenes
         every step. Its `scaling_factor` is then set to 1 / std of the latents, as SD's was.
  UNet   epsilon prediction (Ho et al. 2020) on the scaled latents of a pool of encoded scenes,
         with the min-SNR-5 loss weights (Hang et al. 2023) and the text encoder trained jointly.
         A share of the captions is replaced by "" so that classifier-free guidance works
         (Ho & Salimans 2022). The shipped weights are an exponential moving average.

Everything is seeded: the scenes of step k come from (seed, stage, k), the noise from
`fold_in(key, k)`, so a run resumed from a checkpoint continues as if it had never stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import schedulers  # noqa: E402
from engine.loading.tokenizer import Tokenizer  # noqa: E402
from engine.models.clip import CLIPTextModel  # noqa: E402
from engine.models.unet import UNet2DConditionModel  # noqa: E402
from engine.models.vae import AutoencoderKL  # noqa: E402
from tools import shapes  # noqa: E402
from tools.make_tiny_model import SCHEDULER, UNET, VAE, clip_config, write_model  # noqa: E402
from tools.tiny_tokenizer import write_tokenizer  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vae_steps: int = 2000
    vae_batch: int = 12
    vae_lr: float = 3e-3
    # Posterior noise the decoder must learn to tolerate. At 1e-4 the reconstructions are as sharp, but
    # from a brittle latent code that the UNet cannot hit: its shapes came out half as often. At 3e-2
    # the reconstructions blur.
    kl_weight: float = 1e-2
    edge_weight: float = 4.0  # extra loss weight on pixels next to an edge (see edge_weights)
    unet_steps: int = 8000
    unet_batch: int = 32
    unet_lr: float = 2e-3
    caption_dropout: float = 0.1  # share of captions replaced by "" (the unconditional half of CFG)
    min_snr_gamma: float = 5.0
    ema_decay: float = 0.999
    pool_size: int = 16384  # encoded scenes the UNet stage samples from
    warmup_steps: int = 200
    checkpoint_every: int = 500
    log_every: int = 50


# The generation defaults shipped beside the model (engine/families/loader.py reads jax_sd.json).
GENERATION = {"num_inference_steps": 20, "guidance_scale": 5.0, "scheduler": "ddim"}
EXAMPLE_PROMPTS = [
    "a red circle on a blue background",
    "a yellow star on a purple background",
    "a large white triangle on a black background",
    "a small orange square on a green background",
    "a yellow triangle and a red circle on a green background",
]


def schedule(lr: float, warmup: int, steps: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.05)


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, flush=True)


class Progress:
    """Logs the mean loss, steps per second and the time left, every `every` steps.

    `seconds` is the stage's training time so far, across resumed runs (it is kept in the checkpoint).
    """

    def __init__(self, name: str, total: int, start: int, every: int, seconds: float = 0.0):
        self.name, self.total, self.every = name, total, every
        self.losses: list[float] = []
        self.t0, self.s0, self.before = time.perf_counter(), start, seconds

    @property
    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.t0

    def step(self, step: int, loss) -> None:
        self.losses.append(float(loss))
        if step % self.every and step != self.total:
            return
        rate = (step - self.s0) / max(time.perf_counter() - self.t0, 1e-9)
        left = (self.total - step) / max(rate, 1e-9)
        log(
            f"{self.name} step {step}/{self.total} loss {np.mean(self.losses):.5f} "
            f"{rate:.2f} steps/s, {left / 60:.1f} min left"
        )
        self.losses = []


def save_checkpoint(path: Path, tree, step: int, seconds: float) -> None:
    """Every leaf of `tree` (params, optimizer state, EMA) as one .npz, replaced atomically."""
    tmp = path.with_suffix(".tmp.npz")
    leaves = {f"leaf_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(tree))}
    np.savez(tmp, step=step, seconds=seconds, **leaves)
    os.replace(tmp, path)


def load_checkpoint(path: Path, like):
    """The tree saved at `path`, laid out as `like` (built from the same configs); its step and seconds."""
    data = np.load(path)
    leaves, treedef = jax.tree.flatten(like)
    saved = [data[f"leaf_{i}"] for i in range(sum(name.startswith("leaf_") for name in data.files))]
    shapes_differ = [i for i, (a, b) in enumerate(zip(leaves, saved, strict=False)) if a.shape != b.shape]
    if len(saved) != len(leaves) or shapes_differ:
        raise ValueError(f"{path} was written for other model or optimizer shapes; start without --resume")
    return treedef.unflatten([jnp.asarray(x) for x in saved]), int(data["step"]), float(data["seconds"])


def scene_rng(seed: int, stage: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, stage, step])


# ---- stage 1: the VAE -------------------------------------------------------------------------


def edge_weights(images: jax.Array, edge_weight: float) -> jax.Array:
    """1 on flat colour, 1 + edge_weight within a pixel of an edge: [batch, h, w, 1].

    Edges are a few percent of the pixels but all of the shape; without the weight the
    decoder learns the colours long before the corners and the points of the stars.
    """
    dy = jnp.abs(jnp.diff(images, axis=1)).sum(-1, keepdims=True)
    dx = jnp.abs(jnp.diff(images, axis=2)).sum(-1, keepdims=True)
    edge = (jnp.pad(dy, ((0, 0), (0, 1), (0, 0), (0, 0))) + jnp.pad(dx, ((0, 0), (0, 0), (0, 1), (0, 0)))) > 0.1
    near = jax.lax.reduce_window(edge.astype(jnp.float32), 0.0, jax.lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    return 1.0 + edge_weight * near


def vae_loss(model: AutoencoderKL, images: jax.Array, key: jax.Array, kl_weight: float, edge_weight: float):
    mean, logvar = model.encode(images)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
    error = model.decode(z) - images
    weights = edge_weights(images, edge_weight)
    kl = 0.5 * jnp.mean(mean**2 + jnp.exp(logvar) - 1.0 - logvar)
    return jnp.mean(weights * (jnp.abs(error) + error**2)) + kl_weight * kl


def train_vae(cfg: TrainConfig, work: Path, resume: bool) -> tuple[AutoencoderKL, float]:
    vae = AutoencoderKL(VAE, nnx.Rngs(cfg.seed))
    # Start the posterior narrow (std e^-3): at the default log-variance 0 the sampled latent is
    # mostly noise, and Adam's lr-sized steps take thousands of steps to walk the bias down.
    lat = VAE.latent_channels
    vae.quant_conv.bias[...] = vae.quant_conv.bias[...].at[lat:].set(-6.0)
    tx = optax.adamw(schedule(cfg.vae_lr, cfg.warmup_steps, cfg.vae_steps), weight_decay=0.0)
    graphdef, params = nnx.split(vae)
    ckpt = work / "vae.npz"
    state, start, seconds = {"params": params, "opt": tx.init(params)}, 0, 0.0
    if resume and ckpt.exists():
        state, start, seconds = load_checkpoint(ckpt, state)
        log(f"vae: resumed at step {start}")

    @jax.jit
    def update(state, images, key):
        loss, grads = jax.value_and_grad(
            lambda p: vae_loss(nnx.merge(graphdef, p), images, key, cfg.kl_weight, cfg.edge_weight)
        )(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    key = jax.random.PRNGKey(cfg.seed)
    progress = Progress("vae", cfg.vae_steps, start, cfg.log_every, seconds)
    for step in range(start + 1, cfg.vae_steps + 1):
        images, _ = shapes.batch(scene_rng(cfg.seed, 1, step), cfg.vae_batch)
        state, loss = update(state, jnp.asarray(images), jax.random.fold_in(key, step))
        progress.step(step, loss)
        if step % cfg.checkpoint_every == 0 or step == cfg.vae_steps:
            save_checkpoint(ckpt, state, step, progress.seconds)
    return nnx.merge(graphdef, state["params"]), progress.seconds


# ---- stage 2: the UNet and the text encoder ----------------------------------------------------


@dataclasses.dataclass
class Pool:
    """Encoded scenes: the posterior of each latent, and the caption's token ids."""

    mean: np.ndarray  # [n, 8, 8, 4], unscaled
    std: np.ndarray  # [n, 8, 8, 4]
    ids: np.ndarray  # [n, 77] int32
    scaling_factor: float
    seconds: float  # time it took to encode


def encode_pool(cfg: TrainConfig, vae: AutoencoderKL, tokenizer: Tokenizer, work: Path, resume: bool) -> Pool:
    path = work / "pool.npz"
    if resume and path.exists():
        data = np.load(path)
        return Pool(data["mean"], data["std"], data["ids"], float(data["scaling_factor"]), float(data["seconds"]))
    start = time.perf_counter()
    encode = nnx.jit(lambda m, x: m.encode(x))
    means, stds, ids, cache = [], [], [], {}
    chunk = 256
    for k in range(cfg.pool_size // chunk):
        images, captions = shapes.batch(scene_rng(cfg.seed, 2, k), chunk)
        mean, logvar = encode(vae, jnp.asarray(images))
        means.append(np.asarray(mean))
        stds.append(np.asarray(jnp.exp(0.5 * logvar)))
        for c in captions:
            if c not in cache:
                cache[c] = tokenizer(c)[0][0]
            ids.append(cache[c])
    mean, std = np.concatenate(means), np.concatenate(stds)
    samples = mean + std * np.random.default_rng(cfg.seed).standard_normal(mean.shape, dtype=np.float32)
    pool = Pool(mean, std, np.stack(ids).astype(np.int32), float(1.0 / samples.std()), time.perf_counter() - start)
    np.savez(path, **dataclasses.asdict(pool))
    log(f"pool: {len(mean)} scenes, latent mean {samples.mean():.3f} std {samples.std():.3f}")
    return pool


class Denoiser(nnx.Module):
    """The two trained networks in one module, so that one optimizer and one EMA cover both."""

    def __init__(self, unet: UNet2DConditionModel, text_encoder: CLIPTextModel):
        self.unet = unet
        self.text_encoder = text_encoder


def denoise_loss(model: Denoiser, batch: dict, key: jax.Array, ac: jax.Array, gamma: float) -> jax.Array:
    k_z, k_t, k_noise = jax.random.split(key, 3)
    z = (batch["mean"] + batch["std"] * jax.random.normal(k_z, batch["mean"].shape)) * batch["scale"]
    n = z.shape[0]
    t = jax.random.randint(k_t, (n,), 0, ac.shape[0])
    noise = jax.random.normal(k_noise, z.shape)
    a = ac[t][:, None, None, None]
    noisy = jnp.sqrt(a) * z + jnp.sqrt(1.0 - a) * noise
    context = model.text_encoder(batch["ids"]).last_hidden_state
    predicted = model.unet(noisy, t.astype(jnp.float32), context)
    snr = ac[t] / (1.0 - ac[t])
    weight = jnp.minimum(snr, gamma) / snr  # min-SNR-gamma for epsilon prediction
    return jnp.mean(weight * jnp.mean((predicted - noise) ** 2, axis=(1, 2, 3)))


def train_denoiser(cfg: TrainConfig, pool: Pool, vocab_size: int, empty_ids: np.ndarray, work: Path, resume: bool):
    rngs = nnx.Rngs(cfg.seed + 1)
    model = Denoiser(UNet2DConditionModel(UNET, rngs), CLIPTextModel(clip_config(vocab_size), rngs))
    graphdef, params = nnx.split(model)
    tx = optax.adamw(schedule(cfg.unet_lr, cfg.warmup_steps, cfg.unet_steps), weight_decay=0.0)
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
    ckpt = work / "unet.npz"
    state, start, seconds = {"params": params, "opt": tx.init(params), "ema": params}, 0, 0.0
    if resume and ckpt.exists():
        state, start, seconds = load_checkpoint(ckpt, state)
        log(f"unet: resumed at step {start}")
    # The training noise schedule: the one the shipped scheduler config names, so sampling matches it.
    ac = jnp.asarray(schedulers.alphas_cumprod(schedulers.SchedulerConfig.from_dict(SCHEDULER)))

    @jax.jit
    def update(state, batch, key, step):
        loss, grads = jax.value_and_grad(
            lambda p: denoise_loss(nnx.merge(graphdef, p), batch, key, ac, cfg.min_snr_gamma)
        )(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        decay = jnp.minimum(cfg.ema_decay, (1.0 + step) / (10.0 + step))  # a short EMA while it is young
        ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state["ema"], params)
        return {"params": params, "opt": opt, "ema": ema}, loss

    key = jax.random.PRNGKey(cfg.seed + 1)
    progress = Progress("unet", cfg.unet_steps, start, cfg.log_every, seconds)
    scale = jnp.float32(pool.scaling_factor)
    for step in range(start + 1, cfg.unet_steps + 1):
        rng = scene_rng(cfg.seed, 3, step)
        pick = rng.integers(len(pool.ids), size=cfg.unet_batch)
        ids = np.where(rng.random(cfg.unet_batch)[:, None] < cfg.caption_dropout, empty_ids, pool.ids[pick])
        batch = {"mean": pool.mean[pick], "std": pool.std[pick], "ids": ids, "scale": scale}
        state, loss = update(state, batch, jax.random.fold_in(key, step), jnp.float32(step))
        progress.step(step, loss)
        if step % cfg.checkpoint_every == 0 or step == cfg.unet_steps:
            save_checkpoint(ckpt, state, step, progress.seconds)
    ema: Denoiser = nnx.merge(graphdef, state["ema"])
    return ema.unet, ema.text_encoder, progress.seconds


# ---- the whole run ------------------------------------------------------------------------------


def train(cfg: TrainConfig, out: Path, work: Path, resume: bool = False) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    start = time.perf_counter()
    vocab_size = write_tokenizer(out / "tokenizer", shapes.WORDS)
    tokenizer = Tokenizer(out / "tokenizer")
    vae, vae_s = train_vae(cfg, work, resume)
    pool = encode_pool(cfg, vae, tokenizer, work, resume)
    vae.config = dataclasses.replace(vae.config, scaling_factor=round(pool.scaling_factor, 5))
    unet, text_encoder, unet_s = train_denoiser(cfg, pool, vocab_size, tokenizer("")[0][0], work, resume)
    extra = {**GENERATION, "example_prompts": EXAMPLE_PROMPTS}
    write_model(out, unet, vae, text_encoder, SCHEDULER, np.float16, extra)
    # Training time summed over resumed runs; this run's wall time besides.
    summary = {
        "vae_s": round(vae_s),
        "pool_s": round(pool.seconds),
        "unet_s": round(unet_s),
        "training_s": round(vae_s + pool.seconds + unet_s),
        "this_run_s": round(time.perf_counter() - start),
        "scaling_factor": vae.config.scaling_factor,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"wrote {out}: {json.dumps(summary)}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the diffusers folder to write")
    parser.add_argument("--work", type=Path, required=True, help="checkpoints, latent pool and logs")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints in --work")
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = parser.parse_args()
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    log(f"devices: {jax.devices()}; {json.dumps(dataclasses.asdict(cfg))}")
    train(cfg, args.out, args.work, args.resume)


if __name__ == "__main__":
    main()
