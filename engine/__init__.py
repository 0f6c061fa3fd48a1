"""jax-sd: Stable Diffusion text-to-image in JAX.

from engine import load_pipeline
pipe = load_pipeline()            # the embedded default model; or a folder, or a Hub id
result = pipe.generate("a red circle on a blue background", seed=0)
result.images[0].save("out.png")

Many users at once: `ticket = pipe.submit(GenerationRequest(...))`, then `ticket.events()` (queue
position, progress, previews, the result), `ticket.result()` or `ticket.cancel()`.
"""

from . import request_fields
from .errors import Busy, Cancelled, GenerationFailed, InvalidRequest, SourceError, WeightsError
from .families import VARIANTS, Variant
from .protocol import EngineFace
from .request import SEED_LIMIT, GenerationRequest, GenerationResult, Limits
from .sampling.images import canny_image
from .sampling.pairs import pair_cores
from .serving.engine import DEFAULT_MAX_BATCH_SIZE, Engine
from .serving.model_pool import DEFAULT_MAX_LOADED, ModelPool
from .serving.start import enable_compile_cache, keep_freed_memory, load_models, load_pipeline
from .serving.ticket import Event, Failed, Finished, Loading, Preview, Progress, Queued, Ticket, cancelled

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_LOADED",
    "SEED_LIMIT",
    "VARIANTS",
    "Variant",
    "cancelled",
    "canny_image",
    "pair_cores",
    "Busy",
    "Cancelled",
    "Engine",
    "EngineFace",
    "Event",
    "Failed",
    "Finished",
    "GenerationFailed",
    "GenerationRequest",
    "GenerationResult",
    "InvalidRequest",
    "Limits",
    "Loading",
    "ModelPool",
    "Preview",
    "Progress",
    "Queued",
    "SourceError",
    "Ticket",
    "WeightsError",
    "enable_compile_cache",
    "keep_freed_memory",
    "load_models",
    "load_pipeline",
    "request_fields",
]
