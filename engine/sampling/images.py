"""Picture preparation on the host: control images as the ControlNet pipeline feeds them, Canny edges."""

from __future__ import annotations

import numpy as np
from PIL import Image


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
