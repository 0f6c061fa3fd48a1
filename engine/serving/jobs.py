"""Requests -> jobs: a resolved `GenerationRequest` becomes the `Plan` it runs in and the `Job` the batcher places.

The host side of a request: its prompts tokenized in 75-token chunks with their emphasis, its static
shape (`Plan`), its schedule tables, seeds, the family's extra inputs, and its pictures prepared at the
request's size (control image, image-to-image source and mask). Also the blank job an empty slot holds
and the example admission a plan's programs are traced with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from .. import schedulers
from ..errors import InvalidRequest
from ..families import FAMILIES
from ..families.base import PromptFit, References
from ..families.loader import LoadedModel
from ..request import GenerationRequest, Limits
from ..request_references import fit_reference, reference_size
from ..sampling import modes
from ..sampling.images import control_image_array
from ..sampling.pipeline import Admission, Plan
from ..sampling.prompts import TokenizedPrompt, align, tokenize_plain, tokenize_prompt
from .lora_serving import ServedLoRAs
from .slots import Job
from .ticket import Ticket


def reference_limits(references: References | None) -> dict:
    """`Limits`' fields for a denoiser's reference pictures (`Denoiser.references`): none for one that takes none."""
    if references is None:
        return {"max_references": 0}
    return {
        "max_references": references.max_count,
        "reference_pixels": references.pixels,
        "min_references": references.min_count,
        "reference_resolutions": references.resolutions,
    }


class Jobs:
    """Turns resolved requests of one model into plans and jobs for a batch of `batch_size` slots on `devices`."""

    def __init__(self, model: LoadedModel, limits: Limits, loras: ServedLoRAs, batch_size: int, devices: int):
        self.model = model
        self.limits = limits
        self.loras = loras
        self.batch_size = batch_size
        self.devices = devices
        self._blanks: dict[Plan, Job] = {}

    def prompts(self, r: GenerationRequest) -> tuple[TokenizedPrompt, TokenizedPrompt]:
        """The prompt and the negative prompt in 75-token chunks with their emphasis (engine/sampling/prompts.py),
        padded to one chunk count; refused when longer than `limits.max_chunks`."""
        if FAMILIES[self.model.family].text.chunked_prompts:  # textual inversion embeddings called by name, in both
            tokenize = functools.partial(tokenize_prompt, embeddings=self.model.embeddings.placeholders)
        else:
            tokenize = tokenize_plain
        prompt = tokenize(self.model.tokenizers, r.prompt)
        negative = tokenize(self.model.tokenizers, r.negative_prompt or "")
        self.limits.check_chunks(prompt.chunks, prompt.token_count)
        self.limits.check_chunks(negative.chunks, negative.token_count, "negative prompt")
        return prompt, negative

    def guided(self, r: GenerationRequest) -> bool:
        """Whether the request's plan takes the unconditional row: not for a model that reads the scale as an
        embedding (LCM), nor for a step-distilled one."""
        by_embedding = FAMILIES[self.model.family].denoiser.guided_by_embedding(self.model.denoiser_config)
        return r.guided and self.model.guided and not by_embedding

    def fit(self, r: GenerationRequest) -> PromptFit:
        """How the prompts fit the text side's own tokenizer (T5, Qwen3's chat template): the length they are padded
        to, and what a cut dropped; the negative prompt only where guidance reads it."""
        if self.model.fit_prompts is None:
            return PromptFit()
        return self.model.fit_prompts(r.prompt, (r.negative_prompt or "") if self.guided(r) else None)

    def plan(self, r: GenerationRequest, chunks: int | None = None, fit: PromptFit | None = None) -> Plan:
        """The static shapes of a complete request; `chunks`: its prompts' chunk count (None: tokenizes them);
        `fit`: `fit(r)` where the caller has it."""
        if chunks is None:
            chunks = max(p.chunks for p in self.prompts(r))
        factor = self.model.vae_scale_factor
        return Plan(
            batch=self.batch_size,
            latent_height=r.height // factor,
            latent_width=r.width // factor,
            scheduler=r.scheduler,
            max_steps=self.limits.max_steps,
            guidance=self.guided(r),
            family=self.model.family,
            clip_skip=int(r.clip_skip),
            chunks=chunks,
            devices=self.devices,
            control=r.controlled,
            mode=modes.mode_of(r.image, r.mask_image, r.image_latents),
            deep_cache=int(r.deep_cache) if r.deep_cache > 1 else 0,
            token_merging=float(r.token_merging),
            references=tuple((h, w) for w, h in (reference_size(self.limits, p) for p in r.references or ())),
            text_tokens=(fit or self.fit(r)).length,  # a text side that pads prompts to one of a few lengths
        )

    def _latent_shape(self, plan: Plan) -> tuple[int, int, int]:
        return (plan.latent_height, plan.latent_width, self.model.latent_channels)

    def job(
        self, ticket: Ticket, r: GenerationRequest, plan: Plan, prompts: tuple[TokenizedPrompt, TokenizedPrompt]
    ) -> Job:
        prompt, negative = align(*prompts, chunks=plan.chunks)
        one = dataclasses.replace(plan, batch=1, devices=1)
        extra = {k: v[0] for k, v in self.model.extra_inputs(one, r.prompt, r.negative_prompt).items()}
        family, patch = FAMILIES[self.model.family], self.model.patch_size
        image_tokens = (plan.latent_height // patch) * (plan.latent_width // patch)
        shift = family.sampling.shift
        latents = None
        if r.latents is not None:
            want = (r.num_images, self.model.latent_channels, plan.latent_height, plan.latent_width)
            latents = np.asarray(r.latents, np.float32)
            if latents.shape != want:
                raise InvalidRequest(
                    f"latents must have shape {want} (images, channels, height/8, width/8), got {latents.shape}"
                )
            latents = latents.transpose(0, 2, 3, 1)  # NCHW -> NHWC
        tables = schedulers.tables(
            self.model.scheduler_config,
            r.scheduler,
            r.num_inference_steps,
            plan.max_steps,
            strength=None if plan.mode == "txt2img" else float(1.0 if r.strength is None else r.strength),
            inpaint=plan.mode == "inpaint",
            eta=float(r.eta),
            image_tokens=image_tokens,
            uniform_sigmas=family.sampling.uniform_sigmas,
            mu=None if shift is None else shift(image_tokens, r.num_inference_steps),
        )
        return Job(
            ticket=ticket,
            plan=plan,
            ids=prompt.ids,
            weights=prompt.weights,
            neg_ids=negative.ids,
            neg_weights=negative.weights,
            extra=extra,
            tables=tables,
            seeds=r.image_seeds(),
            guidance_scale=float(r.guidance_scale),
            latents=latents,
            latent_shape=self._latent_shape(plan),
            control=self._control_image(r, plan),
            control_scale=float(r.controlnet_conditioning_scale),
            lora_weights=self.loras.weights(r.lora_scales),
            source=self._source(r, plan),
            references=self._references(r, plan),
        )

    def _control_image(self, r: GenerationRequest, plan: Plan) -> np.ndarray | None:
        """[H, W, 3] in [0, 1], as the ControlNet pipeline preprocesses it; black for an empty slot."""
        if not plan.control:
            return None
        factor = self.model.vae_scale_factor
        height, width = plan.latent_height * factor, plan.latent_width * factor
        if r.control_image is None:
            return np.zeros((height, width, 3), np.float32)
        return control_image_array(r.control_image, height, width)[0]

    def _source(self, r: GenerationRequest, plan: Plan) -> modes.Source | None:
        """One image's picture and mask at the request's size (zeros for an empty slot); None for text-to-image."""
        if plan.mode == "txt2img":
            return None
        if plan.mode == "latents":
            latents = None
            if r.image_latents is not None:
                want = (1, *self._latent_shape(plan))
                latents = np.asarray(r.image_latents, np.float32)
                if latents.shape != want or r.num_images != 1:
                    raise InvalidRequest(
                        f"image_latents must have shape {want} (one image, height/8, width/8, channels) for a request "
                        f"of one image, got {latents.shape} for {r.num_images}"
                    )
                latents = latents[0]
            return modes.Source(**modes.latent_row(latents, self._latent_shape(plan)))
        factor = self.model.vae_scale_factor
        width, height = plan.latent_width * factor, plan.latent_height * factor
        return modes.Source(**modes.source_row(r.image, r.mask_image, width, height, r.inpainting_fill))

    def _references(self, r: GenerationRequest, plan: Plan) -> tuple[np.ndarray, ...]:
        """The reference pictures at their sizes in the plan, as the family's pipeline prepares them (`References.
        prepare`; on a server with fixed sizes, first resized to the shape the plan gives: `fit_reference`), [H, W,
        3] in [-1, 1]; zeros for an empty slot."""
        if not r.references:
            return tuple(np.zeros((h, w, 3), np.float32) for h, w in plan.references)
        prepare = FAMILIES[self.model.family].denoiser.references.prepare
        pictures = zip(r.references, plan.references, strict=True)
        return tuple(prepare(fit_reference(self.limits, p, w, h), w, h) for p, (h, w) in pictures)

    def blank(self, plan: Plan) -> Job:
        """The job an empty slot holds: a schedule of no steps, so the slot never changes."""
        if plan not in self._blanks:
            r = GenerationRequest(
                "",
                "",
                num_inference_steps=1,
                guidance_scale=0.0,
                scheduler=plan.scheduler,
                num_images=1,
                height=1,
                width=1,
            )
            job = self.job(Ticket(r, []), r, plan, self.prompts(r))
            job.tables = dataclasses.replace(job.tables, num_loop_steps=np.int32(0))
            self._blanks[plan] = job
        return self._blanks[plan]

    def example(self, plan: Plan) -> Admission:
        """An admission of empty slots: the shapes and dtypes the plan's programs take."""
        row = self.blank(plan)
        b = plan.batch
        stack = lambda a: np.stack([np.asarray(a)] * b)  # noqa: E731
        return Admission(
            mask=np.zeros(b, bool),
            ids=stack(row.ids),
            weights=stack(row.weights),
            neg_ids=stack(row.neg_ids),
            neg_weights=stack(row.neg_weights),
            extra={k: stack(v) for k, v in row.extra.items()},
            latents=np.zeros((b, *row.latent_shape), np.float32),
            given=np.zeros(b, bool),
            seeds=np.zeros(b, np.uint32),
            guidance_scale=np.zeros(b, np.float32),
            tables=jax.tree.map(stack, row.tables),
            **(dict(control=stack(row.control), control_scale=np.zeros(b, np.float32)) if plan.control else {}),
            source=jax.tree.map(stack, row.source),
            references=tuple(stack(a) for a in row.references),
        )
