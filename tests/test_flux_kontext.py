"""FLUX.1 Kontext: editing a picture from an instruction, against diffusers' `FluxKontextPipeline`.

The transformer reads the reference picture's latents as tokens after the latents' (ids with first axis 1) and
predicts the latents' velocity alone: equal to diffusers' `FluxTransformer2DModel` fed the joined tokens and ids.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from diffusers import FluxKontextPipeline
from diffusers import FluxTransformer2DModel as TorchFlux
from flax import nnx
from reference import nchw, nhwc, randomize, rel_error
from test_transformer_flux import LAYOUTS, inputs, ours_from_torch

TOL = 1e-5  # tiny configs, f32


def kontext_prediction(ref: TorchFlux, x, references, timestep, encoder_hidden_states, pooled_projections, guidance):
    """The transformer's output as FluxKontextPipeline gets it: the latents' tokens, then the reference's, with its
    ids (1, row, col); the output cut back to the latents' tokens and unpacked to NHWC."""
    b, h, w, c = x.shape
    _, rh, rw, _ = references.shape
    packed = FluxKontextPipeline._pack_latents(nchw(x), b, c, h, w)
    image = FluxKontextPipeline._pack_latents(nchw(references), b, c, rh, rw)
    latent_ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    image_ids = FluxKontextPipeline._prepare_latent_image_ids(b, rh // 2, rw // 2, "cpu", torch.float32)
    image_ids[..., 0] = 1
    with torch.no_grad():
        out = ref(
            hidden_states=torch.cat([packed, image], dim=1),
            encoder_hidden_states=torch.from_numpy(encoder_hidden_states),
            pooled_projections=torch.from_numpy(pooled_projections),
            timestep=torch.from_numpy(timestep),
            img_ids=torch.cat([latent_ids, image_ids], dim=0),
            txt_ids=torch.zeros(encoder_hidden_states.shape[1], 3),
            guidance=torch.from_numpy(guidance),
        ).sample[:, : packed.shape[1]]
    return nhwc(FluxKontextPipeline._unpack_latents(out, h * 8, w * 8, 8))


def test_the_transformer_reads_the_reference_as_kontext_does():
    """A reference grid of another shape than the latents': its tokens change the latents' prediction exactly as
    diffusers' joined sequence does (one jitted call: eager JAX compiles every op of the first call apart)."""
    ref = randomize(TorchFlux(**LAYOUTS["dev"]))
    ours = ours_from_torch(ref)
    values = inputs(ours.config, (6, 10), tokens=7)
    values["references"] = np.random.default_rng(5).standard_normal((2, 10, 4, 16)).astype(np.float32)
    want = kontext_prediction(ref, **values)
    graph, state = nnx.split(ours)

    @jax.jit
    def predict(state, x, references, timestep, encoder_hidden_states, pooled_projections, guidance):
        model = nnx.merge(graph, state)
        context = model.project_context(encoder_hidden_states)
        return model(x, timestep, context, pooled_projections, guidance, references=references)

    got = np.asarray(predict(state, **values))
    assert got.shape == (2, 6, 10, 16)
    assert rel_error(got, want) < TOL, np.abs(got - want).max()
