"""What each component of a model folder weighs as this project stores it, in bf16 and with `--quantize int8`,
computed from the folder's configs alone: no weights are read or drawn.

The folder's family (its model_index.json class) builds its networks as `load_pipeline` does, with shapes only
(`nn.layers.shapes_only`), and `--quantize int8` replaces the kernels it replaces at load
(`loading.quantize.int8_components`: the denoiser's and a Qwen3 text encoder's large linear kernels, one byte a weight
and a scale per output channel; embeddings, norms, biases, convolutions and the VAE as they are). So the numbers are
the params the devices hold, text encoder included (`--t5 device`); not activations, compiled programs or the host's
copy of anything.

    python -m tools.model_bytes FOLDER [FOLDER...]   # a diffusers folder: model_index.json and each config.json
    python -m tools.model_bytes --published          # Z-Image-Turbo, FLUX.2 [klein] 4B and 9B (`PUBLISHED`)

`PUBLISHED` holds those models' configs, as their Hub folders' config.json files read (the architecture's fields;
the Hub is not reachable from here, so they were read from public copies: see each entry), written to a temporary
folder and measured as any other. GB is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from engine.families.base import Models
from engine.families.loader import folder_family
from engine.loading.quantize import int8_components, param_bytes, quantize_params, streaming
from engine.loading.sources import resolve
from engine.nn.layers import shapes_only
from tools.published_configs import PUBLISHED

FREE_SPACE = 16e9  # a free Hugging Face Space: 16 GB of memory (2 vCPUs), weights and everything else in it
LOADING_THREADS = 2  # `loading.weights.LOAD_THREADS` there: its 2 vCPUs


def _shapes(source: str | Path, dtype: str) -> tuple[nnx.State, list[str]]:
    """The folder's networks as shape-only params in `dtype`, and the components `--quantize int8` takes."""
    folder = resolve(source)
    family = folder_family(folder)
    configs = {
        name: cls.from_json(folder.component(name) / "config.json")
        for name, cls in family.configs.items()
        if name not in family.optional or folder.has(name)
    }
    with shapes_only():
        _, params = nnx.split(Models(**family.build(configs, nnx.Rngs(0))))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), params)
    chosen = [name for name in int8_components(family.denoiser.component, family.configs, "int8") if name in params]
    return params, chosen


def component_bytes(source: str | Path, dtype: str = "bfloat16") -> dict[str, tuple[int, int]]:
    """component -> (bytes in `dtype`, bytes with `--quantize int8`) of the folder's networks as `load_pipeline`
    builds them (text encoder on the devices), from its configs alone."""
    params, chosen = _shapes(source, dtype)
    quantized = quantize_params(params, chosen)
    return {name: (param_bytes(params[name]), param_bytes(quantized[name])) for name in sorted(params.keys())}


def kernels_in_flight(source: str | Path, threads: int = LOADING_THREADS, dtype: str = "bfloat16") -> int:
    """Bytes a `--quantize int8` load holds at most beside the finished int8 tree (`loading.weights.convert(quantized=)`
    quantizes each kernel as it reads it): `threads` of the largest kernels it quantizes at once, each as its copy in
    `dtype`, `quantize_kernel`'s f32 copy, and its int8 values twice (as made, then aligned for the devices)."""
    params, chosen = _shapes(source, dtype)
    takes = streaming(chosen)
    largest = max(
        (
            math.prod(var.get_value().shape)
            for path, var in nnx.to_flat_state(params)
            if takes(path, var.get_value()) is not None
        ),
        default=0,
    )
    return threads * largest * (jnp.dtype(dtype).itemsize + 4 + 2)


def write_folder(root: Path, files: dict) -> Path:
    """A folder of configs only: model_index.json and each component's config.json (the scheduler's by its name)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if name == "model_index.json":
            path = root / name
        else:
            path = root / name / ("scheduler_config.json" if name == "scheduler" else "config.json")
            path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(content))
    return root


def report(name: str, sizes: dict[str, tuple[int, int]], in_flight: int = 0) -> str:
    """A table of the components, with what a 16 GB free Space keeps for everything else once the int8 weights are
    in, and the peak while loading with int8: the int8 tree and the kernels being quantized (`kernels_in_flight`)."""
    rows = [f"{name}", f"  {'component':<14}{'bf16 GB':>9}{'int8 GB':>9}"]
    rows += [f"  {c:<14}{b / 1e9:>9.2f}{q / 1e9:>9.2f}" for c, (b, q) in sizes.items()]
    bf16, int8 = (sum(s[i] for s in sizes.values()) for i in (0, 1))
    rows.append(f"  {'total':<14}{bf16 / 1e9:>9.2f}{int8 / 1e9:>9.2f}")
    rows.append(
        f"  computed, not measured: with int8, {(FREE_SPACE - int8) / 1e9:.2f} GB of a 16 GB free Space left for "
        f"activations and the runtime; {(int8 + in_flight) / 1e9:.2f} GB held at most while loading "
        f"({LOADING_THREADS} loading threads)"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", help="diffusers-format folders (their configs are all that is read)")
    parser.add_argument("--published", action="store_true", help="Z-Image-Turbo and FLUX.2 [klein] 4B and 9B")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {str(f): f for f in args.folders}
        if args.published:
            sources.update({n: write_folder(Path(tmp) / n.replace("/", "--"), c) for n, c in PUBLISHED.items()})
        for name, source in sources.items():
            print(report(name, component_bytes(source), kernels_in_flight(source)))


if __name__ == "__main__":
    main()
