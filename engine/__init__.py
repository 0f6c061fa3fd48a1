"""jax-sd: Stable Diffusion text-to-image in JAX.

from engine import load_pipeline
pipe = load_pipeline()            # the embedded default model; or a folder, or a Hub id
result = pipe.generate("a red circle on a blue background", seed=0)
result.images[0].save("out.png")

Many users at once: `ticket = pipe.submit(GenerationRequest(...))`, then `ticket.events()` (queue
position, progress, previews, the result), `ticket.result()` or `ticket.cancel()`.
"""

from .batcher import GenerationFailed
from .request import Busy, Cancelled, GenerationRequest, GenerationResult, InvalidRequest, Limits
from .serving import Engine, enable_compile_cache, load_pipeline
from .sources import SourceError
from .ticket import Failed, Finished, Preview, Progress, Queued, Ticket
from .weights import WeightsError

__all__ = [
    "Busy",
    "Cancelled",
    "Engine",
    "Failed",
    "Finished",
    "GenerationFailed",
    "GenerationRequest",
    "GenerationResult",
    "InvalidRequest",
    "Limits",
    "Preview",
    "Progress",
    "Queued",
    "SourceError",
    "Ticket",
    "WeightsError",
    "enable_compile_cache",
    "load_pipeline",
]
