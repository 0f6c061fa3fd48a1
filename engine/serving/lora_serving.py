"""The LoRAs a server loaded, and the merged params that a batch runs with.

`load_pipeline(source, loras={"name": path})` reads each file once (`lora.load_lora`, `lora.lora_factors`:
a file that does not fit the model is refused at load, with its tensors' names). A request weighs them
with `lora_scales` (a loaded LoRA left out keeps 1.0, as after diffusers' `load_lora_weights`).

Merged kernels are shared by every slot of a batch, so requests with other weights cannot share one: the
batcher keys its batches by (plan, weights), while programs stay keyed by plan. A batch's params are
merged once, when it starts, by one jitted `apply_loras` whose weights are a traced array: new weights
never compile anything. Only the adapted kernels are merged and held anew; every other leaf is the
served params' own array. The last few merges are kept, so a stream of requests with the same weights
merges once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from ..loading.lora import LoRAFactors, apply_loras

Weights = tuple[float, ...]  # one per loaded LoRA, in load order


class ServedLoRAs:
    """Name -> factors (on the devices, replicated), and merged params by weights."""

    def __init__(self, factors: Mapping[str, LoRAFactors], replicated: NamedSharding, keep: int = 2):
        self.names: tuple[str, ...] = tuple(factors)
        self._replicated = replicated
        self._factors = jax.device_put([factors[name] for name in self.names], replicated)
        self._paths = set().union(*(set(f) for f in factors.values())) if factors else set()
        self._merge = jax.jit(apply_loras, out_shardings=replicated)
        self._merged: OrderedDict[Weights, nnx.State] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def add(self, factors: Mapping[str, LoRAFactors]) -> None:
        """More LoRAs after those loaded (a models folder's `Lora/`, at a prompt's first call of each). A job made
        before holds fewer weights: the LoRAs added since count 0 for it, as it never named them."""
        new = {name: f for name, f in factors.items() if name not in self.names}
        if not new:
            return
        placed = jax.device_put(list(new.values()), self._replicated)
        with self._lock:
            self._factors = [*self._factors, *placed]
            self._paths = self._paths.union(*(set(f) for f in new.values()))
            self.names = (*self.names, *new)

    def weights(self, lora_scales: Mapping[str, float] | None) -> Weights:
        """The request's weights in load order; a name left out: 1.0."""
        scales = lora_scales or {}
        return tuple(float(scales.get(name, 1.0)) for name in self.names)

    @property
    def merges_compiled(self) -> int:
        """Programs compiled for merging: one, whatever the weights."""
        return self._merge._cache_size()

    def params(self, base: nnx.State, weights: Weights) -> nnx.State:
        """`base` with every LoRA merged at its weight; `base` itself when every weight is 0 (or none loaded)."""
        if not any(weights):
            return base
        with self._lock:
            factors, paths = self._factors, self._paths
            weights = (*weights, *[0.0] * (len(factors) - len(weights)))  # LoRAs added since the job was made
            if weights in self._merged:
                self._merged.move_to_end(weights)
                return self._merged[weights]
        flat = list(nnx.to_flat_state(base))
        adapted = nnx.from_flat_state([(path, var) for path, var in flat if path in paths])
        merged = dict(nnx.to_flat_state(self._merge(adapted, factors, jnp.asarray(weights, np.float32))))
        params = nnx.from_flat_state([(path, merged.get(path, var)) for path, var in flat])
        with self._lock:
            self._merged[weights] = params
            while len(self._merged) > self._keep:
                self._merged.popitem(last=False)
        return params
