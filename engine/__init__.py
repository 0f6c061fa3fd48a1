"""jax-sd: Stable Diffusion text-to-image in JAX.

from engine import load_pipeline
pipe = load_pipeline()            # the embedded default model; or a folder, or a Hub id
result = pipe.generate("a red circle on a blue background", seed=0)
result.images[0].save("out.png")
"""

from .serving import Engine, GenerationResult, InvalidRequest, enable_compile_cache, load_pipeline
from .sources import SourceError
from .weights import WeightsError

__all__ = [
    "Engine",
    "GenerationResult",
    "InvalidRequest",
    "SourceError",
    "WeightsError",
    "enable_compile_cache",
    "load_pipeline",
]
