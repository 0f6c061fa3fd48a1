"""A text encoder kept on the host: its weights in host memory, run on the CPU once per request.

T5-XXL (SD3's `text_encoder_3`, FLUX.1's `text_encoder_2`) is 4.7B parameters, 9.5 GB in bf16: on an accelerator
it takes more memory than the SD 3.5 medium transformer it conditions, and it runs once per prompt, not once per
step. With `load_pipeline(t5="host")` (`--t5 host`) its weights stay out of the devices' param tree; this runs it
on the CPU backend when a request is tokenized, and the embeddings travel with the request like its token ids.
Qwen3-4B (Z-Image's and FLUX.2 [klein]'s text encoder, 8 GB in bf16) runs there the same way (`host_qwen3`): its
ids and attention mask in, the hidden layers its pipeline reads out. With `--quantize int8` its linear kernels are
kept there as int8 (`HostEncoder(int8=True)`: about half their bf16 bytes, each quantized as it is read, as
`quantize.quantize_module` would quantize the loaded tree), widened inside the program that reads them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from .quantize import dequantize, streaming
from .weights import convert


class HostEncoder:
    """`module()` with `tensors` loaded (strictly), jitted on the CPU: ids [batch, tokens] (and whatever else `call`
    reads) -> hidden states numpy. `call(model, *inputs)`: what a run returns; by default `model(ids)`."""

    def __init__(
        self,
        module: Callable[[], nnx.Module],
        tensors: dict[str, np.ndarray],
        dtype: str,
        where: str,
        call: Callable[..., jax.Array] | None = None,
        int8: bool = False,
        keep: tuple[str, ...] = (),
    ):
        # int8: the large linear kernels kept as int8, quantized as they are read (`quantize.streaming`)
        graphdef, params = convert(module, tensors, dtype, where=where, quantized=streaming(None) if int8 else None)
        self.cpu = jax.devices("cpu")[0]
        self.params = jax.device_put(params, self.cpu)
        call = call or (lambda model, ids: model(ids))
        # int8 kernels (`quantize`) widened inside the program, but those under `keep`, which the module widens
        # itself a layer at a time (Qwen3's `layers`); a tree without them runs as it is
        self._run = jax.jit(lambda p, *inputs: call(nnx.merge(graphdef, dequantize(p, keep=keep)), *inputs))
        self.lock = threading.Lock()  # one prompt at a time: the CPU is shared with whoever submits

    def __call__(self, ids: np.ndarray, *inputs: np.ndarray) -> np.ndarray:
        with self.lock, jax.default_device(self.cpu):
            arrays = (jax.device_put(np.asarray(x), self.cpu) for x in (ids, *inputs))
            return np.asarray(self._run(self.params, *arrays))

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self.params))


def host_t5(
    component: str, config: Any, tensors: dict[str, np.ndarray], dtype: str, where: str, int8: bool = False
) -> HostEncoder:
    """The folder's T5 (sub-folder `component`, its tensors without the prefix) as a `HostEncoder`."""
    from ..models.t5 import T5EncoderModel

    return HostEncoder(lambda: T5EncoderModel(config, nnx.Rngs(0)), tensors, dtype, f"{where} {component}", int8=int8)


def host_qwen3(
    component: str,
    config: Any,
    tensors: dict[str, np.ndarray],
    dtype: str,
    where: str,
    hidden_layers: Sequence[int],
    int8: bool = False,
) -> HostEncoder:
    """The folder's Qwen3 (a `Qwen3Model` or `Qwen3ForCausalLM`'s tensors) as a `HostEncoder` of its first layers
    up to the last of `hidden_layers` (transformers' `hidden_states` indices): (ids, mask) -> those states side by
    side, [batch, tokens, len(hidden_layers) * hidden_size]."""
    from ..models.qwen3 import Qwen3Model, encoder_tensors, layers_needed, prompt_embeds

    layers, hidden_layers = layers_needed(config, hidden_layers), tuple(hidden_layers)
    return HostEncoder(
        lambda: Qwen3Model(config, nnx.Rngs(0), num_layers=layers),
        encoder_tensors(tensors, config, layers, f"{where} {component}"),
        dtype,
        f"{where} {component}",
        call=lambda model, ids, mask: prompt_embeds(config, model(ids, mask), hidden_layers),
        int8=int8,
        keep=Qwen3Model.WIDENED_BLOCKS,  # widened by the model, one layer after another (`nn.int8_weights.widened`)
    )
