"""Other APIs' names for our values, in one place: AUTOMATIC1111's samplers, schedules, clip skip and `<lora:...>`
tags, OpenAI's sizes and schedulers, and ComfyUI's sampler and scheduler names. The doors (a1111.py,
openai_images.py, comfy.py) ask here and never spell a foreign name themselves; every function raises
`engine.InvalidRequest` with the names it accepts.

A1111 1.9 split a sampler (the algorithm: "DPM++ 2M") from its scheduler (the noise schedule: "Karras"); a
client may also send the older joined name ("DPM++ 2M Karras"). Our scheduler kinds are the pairs, and
`engine.compat.pnginfo.SAMPLER_NAMES` names each kind as A1111 writes it in a picture's parameters.
"""

from __future__ import annotations

import re
from typing import Any

import engine
from engine.compat.pnginfo import SAMPLER_NAMES

from .requests import as_float

KARRAS_SUFFIX = " Karras"
# Our kind -> (A1111's sampler, its schedule): "uniform" is the model's own spacing of the noise levels.
KINDS = {
    kind: (name.removesuffix(KARRAS_SUFFIX), "karras" if name.endswith(KARRAS_SUFFIX) else "uniform")
    for kind, name in SAMPLER_NAMES.items()
}
# k-diffusion's and A1111's older aliases of each sampler, as /sdapi/v1/samplers lists them.
SAMPLER_ALIASES = {
    "Euler a": ("k_euler_a", "k_euler_ancestral"),
    "Euler": ("k_euler",),
    "DPM++ 2M": ("k_dpmpp_2m",),
    "DDIM": ("ddim",),
    "PLMS": ("plms",),
    "LCM": ("k_lcm",),
    "TCD": ("tcd",),
}
# A1111's schedulers (name -> label, aliases). "automatic" is each sampler's own choice (Karras for DPM++ 2M, as
# A1111 picks it); A1111's other even spacings of the model's own steps are read as "uniform".
SCHEDULES = {
    "automatic": ("Automatic", ()),
    "uniform": ("Uniform", ("normal", "simple", "sgm_uniform")),
    "karras": ("Karras", ()),
}
_AUTOMATIC = {"DPM++ 2M": "karras"}
_SCHEDULE_OF = {
    spelling.lower(): name for name, (label, aliases) in SCHEDULES.items() for spelling in (name, label, *aliases)
}
# A1111's extra-network tags in a prompt: <lora:name>, <lora:name:0.8> (LyCORIS files load as LoRAs too).
LORA_TAG = re.compile(r"<(?:lora|lyco):([^:>]+)(?::([^>]*))?>", re.IGNORECASE)


def _refuse(message: str) -> engine.InvalidRequest:
    return engine.InvalidRequest(message)


def samplers(pipe: engine.EngineFace) -> list[str]:
    """A1111's names of the samplers this model serves, in our order (each once: the schedule is apart)."""
    return list(dict.fromkeys(KINDS[kind][0] for kind in pipe.limits.schedulers if kind in KINDS))


def sampler_aliases(name: str, pipe: engine.EngineFace) -> list[str]:
    """A sampler's other accepted spellings: A1111's aliases, then our kinds."""
    ours = [kind for kind in pipe.limits.schedulers if KINDS.get(kind, ("",))[0] == name]
    return list(dict.fromkeys([*SAMPLER_ALIASES.get(name, ()), *ours]))


def _sampler(pipe: engine.EngineFace, name: str) -> tuple[str, str | None]:
    """(A1111's sampler, the schedule its name implies) for a sampler name, alias or our kind, any case."""
    wanted = name.strip().lower()
    for sampler in samplers(pipe):
        for spelling in (sampler, *sampler_aliases(sampler, pipe)):
            if spelling.lower() == wanted:
                kind = spelling if spelling in KINDS else None
                return sampler, KINDS[kind][1] if kind else None
            if (spelling + KARRAS_SUFFIX).lower() == wanted:  # A1111 before 1.9: "DPM++ 2M Karras"
                return sampler, "karras"
    raise _refuse(f"unknown sampler {name!r}; this server offers: {', '.join(samplers(pipe))}")


def _kind_of(pipe: engine.EngineFace, pair: tuple[str, str]) -> str | None:
    """The model's kind for A1111's (sampler, schedule): "Euler" is `euler` for a noise-predicting model and
    `flow_euler` for a flow model, which take only their own side's kinds."""
    return next((kind for kind in pipe.limits.schedulers if KINDS.get(kind) == pair), None)


def a1111_scheduler(pipe: engine.EngineFace, sampler_name: Any, scheduler: Any = None) -> str:
    """Our scheduler kind for A1111's `sampler_name` and `scheduler`; no sampler: the model's own default."""
    if not isinstance(sampler_name, str) or not sampler_name.strip():
        return pipe.defaults["scheduler"]
    sampler, implied = _sampler(pipe, sampler_name)
    wanted = str(scheduler).strip().lower() if scheduler not in (None, "") else "automatic"
    schedule = _SCHEDULE_OF.get(wanted)
    if schedule is None:
        labels = ", ".join(label for label, _ in SCHEDULES.values())
        raise _refuse(f"unknown scheduler {scheduler!r}; this server offers: {labels}")
    if implied is not None:  # the sampler's own name says it ("DPM++ 2M Karras")
        schedule = implied
    elif schedule == "automatic":
        schedule = _AUTOMATIC.get(sampler, "uniform")
        if _kind_of(pipe, (sampler, schedule)) is None:
            schedule = "uniform"
    kind = _kind_of(pipe, (sampler, schedule))
    if kind is None:
        label = SCHEDULES[schedule][0]
        raise _refuse(f"sampler {sampler!r} has no {label} schedule here; use scheduler Automatic or Uniform")
    return kind


def a1111_names(kind: str) -> tuple[str, str]:
    """A1111's (sampler, scheduler label) for one of our kinds: ("DPM++ 2M", "Karras")."""
    sampler, schedule = KINDS[kind]
    return sampler, SCHEDULES[schedule][0]


def take_loras(prompt: str) -> tuple[str, dict[str, float]]:
    """A prompt without its `<lora:name:weight>` tags, and those weights (a tag without one: 1.0), as A1111
    reads them; the engine refuses a name the server did not load."""
    weights: dict[str, float] = {}
    for match in LORA_TAG.finditer(prompt):
        name, rest = match.group(1).strip(), (match.group(2) or "").split(":")[0].strip()
        weights[name] = as_float(rest, f"LoRA {name!r} weight") if rest else 1.0
    if not weights:
        return prompt, {}
    return re.sub(r"\s{2,}", " ", LORA_TAG.sub("", prompt)).strip(), weights


def our_scheduler(pipe: engine.EngineFace, value: Any) -> str | None:
    """OpenAI's extra `scheduler` field: our kind ("euler_a"), or an A1111 sampler name; None: the default."""
    if value is None or value == "":
        return None
    if value in pipe.limits.schedulers:
        return value
    if isinstance(value, str):
        return a1111_scheduler(pipe, value)
    raise _refuse(f"scheduler must be one of {', '.join(pipe.limits.schedulers)}, not {value!r}")


def openai_size(value: Any) -> tuple[int | None, int | None]:
    """OpenAI's `size` ("1024x1024", "auto" or none: the model's own) as (width, height)."""
    if value is None or str(value).strip().lower() in ("", "auto"):
        return None, None
    match = re.fullmatch(r"\s*(\d+)\s*[x×]\s*(\d+)\s*", str(value).lower())
    if not match:
        raise _refuse(f"size must be written WIDTHxHEIGHT, like 512x512, or auto; not {value!r}")
    return int(match.group(1)), int(match.group(2))


# ComfyUI's KSampler names (k-diffusion's) -> A1111's sampler, and its schedulers -> A1111's schedules ("normal",
# "simple", "sgm_uniform" and "ddim_uniform" all space the model's own steps evenly: our "uniform").
COMFY_SAMPLERS = {
    "euler": "Euler",
    "euler_ancestral": "Euler a",
    "dpmpp_2m": "DPM++ 2M",
    "ddim": "DDIM",
    "lcm": "LCM",
    "tcd": "TCD",
}
COMFY_SCHEDULERS = {
    "normal": "uniform",
    "simple": "uniform",
    "sgm_uniform": "uniform",
    "ddim_uniform": "uniform",
    "karras": "karras",
}


def comfy_samplers(pipe: engine.EngineFace) -> list[str]:
    """ComfyUI's names of the samplers this model serves (KSampler's `sampler_name` choices)."""
    offered = samplers(pipe)
    return [name for name, a1111 in COMFY_SAMPLERS.items() if a1111 in offered]


def comfy_schedulers(pipe: engine.EngineFace) -> list[str]:
    """ComfyUI's names of the schedules some sampler of this model runs (KSampler's `scheduler` choices)."""
    schedules = {KINDS[kind][1] for kind in pipe.limits.schedulers if kind in KINDS}
    return [name for name, schedule in COMFY_SCHEDULERS.items() if schedule in schedules]


def comfy_scheduler(pipe: engine.EngineFace, sampler_name: Any, scheduler: Any) -> str:
    """Our scheduler kind for ComfyUI's KSampler `sampler_name` and `scheduler`."""
    sampler = COMFY_SAMPLERS.get(sampler_name) if isinstance(sampler_name, str) else None
    if sampler is None or sampler_name not in comfy_samplers(pipe):
        raise _refuse(f"unknown sampler_name {sampler_name!r}; this server offers: {', '.join(comfy_samplers(pipe))}")
    schedule = COMFY_SCHEDULERS.get(scheduler) if isinstance(scheduler, str) else None
    if schedule is None:
        raise _refuse(f"unknown scheduler {scheduler!r}; this server offers: {', '.join(comfy_schedulers(pipe))}")
    kind = _kind_of(pipe, (sampler, schedule))
    if kind is None:
        raise _refuse(f"sampler_name {sampler_name!r} has no {scheduler!r} schedule here; use normal")
    return kind
