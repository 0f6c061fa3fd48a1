"""Sampling as jitted programs over a batch of image slots: `pipeline.py` (the static `Plan`, the slots, and
`admit` / `advance` / `decode`), prompts in chunks with emphasis (`prompts.py`), image-to-image and inpainting
(`modes.py`), control pictures and Canny edges (`images.py`), the live preview map (`preview.py`), the
sharding constraints that split one image over a core pair (`pairs.py`), pictures upscaled by a network in
tiles or resampled by PIL (`upscale.py`), hires fix's latent upscalers (`hires.py`), and A1111's picture and mask
preparation for image to image (resize modes, mask blur, "only masked", fill) and its paste-back (`inpaint.py`).

The programs ask a family's record (`engine.families.FAMILIES[plan.family]`) how to encode a prompt and call the
denoiser, and a scheduler module (`engine.schedulers`) how to step; they never name either.

May import: `engine.families`, `engine.schedulers`, `engine.models`, `engine.nn`, `engine.errors`,
`engine.request`.
"""
