"""A text encoder kept on the host: its weights in host memory, run on the CPU once per request.

T5-XXL (SD3's `text_encoder_3`, FLUX.1's `text_encoder_2`) is 4.7B parameters, 9.5 GB in bf16: on an accelerator
it takes more memory than the SD 3.5 medium transformer it conditions, and it runs once per prompt, not once per
step. With `load_pipeline(t5="host")` (`--t5 host`) its weights stay out of the devices' param tree; this runs it
on the CPU backend when a request is tokenized, and the embeddings travel with the request like its token ids.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from .weights import convert


class HostEncoder:
    """`module()` with `tensors` loaded (strictly), jitted on the CPU: ids [batch, tokens] -> hidden states numpy."""

    def __init__(self, module: Callable[[], nnx.Module], tensors: dict[str, np.ndarray], dtype: str, where: str):
        graphdef, params = convert(module, tensors, dtype, where=where)
        self.cpu = jax.devices("cpu")[0]
        self.params = jax.device_put(params, self.cpu)
        self._run = jax.jit(lambda p, ids: nnx.merge(graphdef, p)(ids))
        self.lock = threading.Lock()  # one prompt at a time: the CPU is shared with whoever submits

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        with self.lock, jax.default_device(self.cpu):
            return np.asarray(self._run(self.params, jax.device_put(np.asarray(ids), self.cpu)))

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self.params))


def host_t5(component: str, config: Any, tensors: dict[str, np.ndarray], dtype: str, where: str) -> HostEncoder:
    """The folder's T5 (sub-folder `component`, its tensors without the prefix) as a `HostEncoder`."""
    from ..models.t5 import T5EncoderModel

    return HostEncoder(lambda: T5EncoderModel(config, nnx.Rngs(0)), tensors, dtype, f"{where} {component}")
