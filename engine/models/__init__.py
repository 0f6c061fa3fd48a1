"""The networks, one file each, in Flax NNX: CLIP text and vision encoders, the UNet, the KL VAE, the tiny
autoencoder (TAESD), the ControlNet and the safety checker; `config.py` holds their frozen configs, whose field
names are copied from each folder's `config.json`.

Module attribute paths mirror the diffusers key paths, so loading weights is one table (`loading/weights.py`).
A network knows nothing of families, requests or devices.

May import: `engine.nn`, `engine.errors`, jax, flax, numpy.
"""
