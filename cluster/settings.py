"""The cluster's one settings record: what the replicas load and how the page in front of them queues.

The Serve config's `args` (serve_config.yaml) fill it; where replicas run and how many there are is Ray
Serve's own part of that config (`deployments:`), not ours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine import DEFAULT_MAX_BATCH_SIZE


@dataclass(frozen=True)
class ClusterSettings:
    model: str | None = None  # Hub id or folder on every replica host; None: the embedded model
    dtype: str | None = None  # None: the host's best (engine.serving.start.default_dtype)
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # pictures one replica draws at once
    sizes: str | tuple[tuple[int, int], ...] = "common"  # "common", or ((width, height), ...): the sizes offered
    images_per_device: int = 1  # the page's default; the warm-up compiles its width
    chunk_steps: int = 1  # denoising steps between the engine's progress reports
    queue_size: int = 48  # requests waiting in the page's Gradio queue; more are refused at once
    concurrency: int = 64  # requests the page hands the replicas at once (Serve queues what they cannot take)
    retries: int = 1  # a request whose replica dies is drawn again on another replica this many times
    controlnet: str | None = None  # a ControlNet folder or Hub id on every replica host, as app.py's --controlnet
    vae: str | None = None  # a VAE folder or Hub id in place of the model's own, as app.py's --vae
    t5: str = "device"  # where SD3's and FLUX.1's T5 runs: device, host or off, as app.py's --t5
    quantize: str | None = None  # "int8": the denoiser's kernels as int8, as app.py's --quantize
    loras: tuple[tuple[str, str], ...] = ()  # (name, path or Hub id) pairs, as app.py's --lora NAME=PATH

    @classmethod
    def from_args(cls, args: dict | None) -> ClusterSettings:
        """The Serve config's `args`; an unknown key is refused by name, as a typo would otherwise be ignored."""
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown settings {unknown}; the known ones are {sorted(known)}")
        sizes = args.get("sizes")
        if isinstance(sizes, str) and sizes != "common":  # "512x512,768x512", as app.py's --sizes
            sizes = [item.strip().lower().split("x") for item in sizes.split(",")]
        if isinstance(sizes, list | tuple):
            args["sizes"] = tuple(tuple(int(v) for v in pair) for pair in sizes)
        loras = args.get("loras")
        if isinstance(loras, dict):  # {name: path} in the YAML
            args["loras"] = tuple((str(k), str(v)) for k, v in loras.items())
        elif isinstance(loras, list | tuple):
            args["loras"] = tuple(tuple(pair) for pair in loras)
        return cls(**args)

    def engine_sizes(self) -> str | list[tuple[int, int]]:
        return self.sizes if isinstance(self.sizes, str) else [tuple(pair) for pair in self.sizes]
