"""The networks, one file each, in Flax NNX: CLIP text and vision encoders, T5 v1.1, Qwen3 read for its hidden
states (`qwen3.py`: Z-Image's and FLUX.2 [klein]'s text encoder), the UNet, the MMDiT
transformers of SD3 (`transformer_sd3.py`), FLUX.1 (`transformer_flux.py`) and FLUX.2 (`transformer_flux2.py`),
Z-Image's single-stream DiT (`transformer_z_image.py`), the KL VAE (and FLUX.2's, `vae_flux2.py`, with its
patchified, normalised latent space), the tiny autoencoder (TAESD), the ControlNet, the safety checker, and the
upscalers RRDBNet and SRVGGNetCompact (`upscalers.py`, named after Real-ESRGAN's keys). `config.py` holds the
frozen configs of the UNet, VAE and CLIP; T5's, Qwen3's, the transformers' and the upscalers' sit beside their
models. Field names are copied from each folder's `config.json`.

Module attribute paths mirror the diffusers key paths, so loading weights is one table (`loading/weights.py`).
A network knows nothing of families, requests or devices.

May import: `engine.nn`, `engine.errors`, jax, flax, numpy.
"""
