"""Stand-ins for diffusers' Flax schedulers (`FlaxPNDMScheduler`, `FlaxDDIMScheduler`, ...), which diffusers 0.40 deleted.

Old code builds one as `scheduler, state = FlaxDPMSolverMultistepScheduler.from_pretrained(model_id,
subfolder="scheduler")`, passes `scheduler=scheduler` to the pipeline and puts `state` in
`params["scheduler"]`. Here each class names one of our scheduler kinds (`engine.schedulers`, which
match diffusers' PyTorch schedulers step for step), and the state says which kind and config to run.
The state holds no arrays: the per-step tables are computed on the host for each call's step count,
so `replicate`, `tree_map(astype)` and `params.pop("scheduler")` pass it through unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, ClassVar

import jax

from .. import schedulers
from ..errors import ConfigError, SourceError
from ..schedulers import SchedulerConfig

# Keywords old code passes to a scheduler's from_pretrained/from_config that mean nothing here.
_IGNORED_OPTIONS = frozenset({"dtype", "revision", "cache_dir", "token", "use_auth_token", "local_files_only"})


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class FlaxSchedulerState:
    """What `params["scheduler"]` holds: the kind and config of the schedule. Static (no leaves), so jit-safe."""

    kind: str
    config: SchedulerConfig


def _read_config(source: str | Path, subfolder: str | None) -> dict[str, Any]:
    """scheduler_config.json from a folder (or its `subfolder`), or just that file from the Hub."""
    name = "scheduler_config.json"
    folder = Path(source).expanduser()
    if folder.is_dir():
        for candidate in (folder / (subfolder or ""), folder):
            if (candidate / name).is_file():
                return json.loads((candidate / name).read_text())
        raise SourceError(f"{source}: no {subfolder + '/' if subfolder else ''}{name}")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)):
        raise SourceError(f"scheduler source {str(source)!r} is neither a folder nor a Hub id like 'owner/name'")
    import huggingface_hub

    try:
        path = huggingface_hub.hf_hub_download(str(source), name, subfolder=subfolder)
    except Exception as err:  # offline, missing, gated: one message that says what to do
        raise SourceError(
            f"cannot fetch {subfolder or ''}/{name} of {source!r} ({type(err).__name__}: {err}); "
            "download the model where there is a network and pass its folder"
        ) from err
    return json.loads(Path(path).read_text())


class FlaxScheduler:
    """A scheduler as the old Flax pipelines took it: a config, `create_state()`, `from_pretrained`, `from_config`."""

    kind_name: ClassVar[str]  # the `engine.schedulers` kind this class runs
    has_state: ClassVar[bool] = True

    def __init__(self, config: SchedulerConfig | None = None, **options: Any):
        fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = sorted(set(options) - fields - _IGNORED_OPTIONS)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown options {', '.join(unknown)}")
        known = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if k in fields}
        self._config = dataclasses.replace(config or SchedulerConfig(), **known)
        self._check()
        schedulers.settings(self._config, self.kind)  # unsupported options fail here, at load, not mid-call

    def _check(self) -> None:
        pass

    @property
    def kind(self) -> str:
        return self.kind_name

    @property
    def config(self) -> dict[str, Any]:
        """The scheduler_config.json keys that are set, as `Other.from_config(scheduler.config)` takes them."""
        set_keys = {k: v for k, v in dataclasses.asdict(self._config).items() if v is not None and k != "class_name"}
        return {"_class_name": type(self).__name__, **set_keys}

    @classmethod
    def from_config(cls, config: dict[str, Any] | SchedulerConfig, **options: Any) -> FlaxScheduler:
        if not isinstance(config, SchedulerConfig):
            config = SchedulerConfig.from_dict(dict(config), where=f"{cls.__name__}.from_config")
        return cls(config, **options)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | Path, subfolder: str | None = None, **options: Any
    ) -> tuple[FlaxScheduler, FlaxSchedulerState]:
        """(scheduler, state) from a model folder or Hub id, as the old Flax schedulers returned them."""
        options.pop("return_unused_kwargs", None)
        raw = _read_config(pretrained_model_name_or_path, subfolder)
        scheduler = cls.from_config(SchedulerConfig.from_dict(raw, where=str(pretrained_model_name_or_path)), **options)
        return scheduler, scheduler.create_state()

    def create_state(self, common: Any = None) -> FlaxSchedulerState:
        # The class a config was saved with is no part of the schedule: states of equal schedules are equal.
        return FlaxSchedulerState(self.kind, dataclasses.replace(self._config, class_name=None))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r})"


class FlaxPNDMScheduler(FlaxScheduler):
    kind_name = "pndm"

    def _check(self) -> None:
        if not self._config.skip_prk_steps:  # diffusers' default is False; SD 1.x folders set it
            raise ConfigError(
                f"{type(self).__name__}: only PLMS runs here, skip_prk_steps=True as SD 1.x folders set it "
                "(the Runge-Kutta warm-up is not supported); or use FlaxDDIMScheduler"
            )


class FlaxDDIMScheduler(FlaxScheduler):
    kind_name = "ddim"


class FlaxEulerDiscreteScheduler(FlaxScheduler):
    kind_name = "euler"


class FlaxEulerAncestralDiscreteScheduler(FlaxScheduler):
    """Not in old diffusers' Flax; here so that folders that ship it (SDXL-Turbo) load with their own scheduler."""

    kind_name = "euler_a"


class FlaxDPMSolverMultistepScheduler(FlaxScheduler):
    """DPM-Solver++(2M), the old Flax class's defaults; Karras sigmas when the config asks for them."""

    kind_name = "dpm++2m"

    def _check(self) -> None:
        cfg = self._config
        if cfg.algorithm_type not in (None, "dpmsolver++") or cfg.solver_order not in (None, 2):
            raise ConfigError(
                f"{type(self).__name__}: algorithm_type={cfg.algorithm_type!r}, solver_order={cfg.solver_order!r} "
                "is not supported; only DPM-Solver++ of order 2 (algorithm_type='dpmsolver++', solver_order=2)"
            )

    @property
    def kind(self) -> str:
        return "dpm++2m_karras" if self._config.use_karras_sigmas else "dpm++2m"


STAND_INS: dict[str, type[FlaxScheduler]] = {
    "pndm": FlaxPNDMScheduler,
    "ddim": FlaxDDIMScheduler,
    "euler": FlaxEulerDiscreteScheduler,
    "euler_a": FlaxEulerAncestralDiscreteScheduler,
    "dpm++2m": FlaxDPMSolverMultistepScheduler,
    "dpm++2m_karras": FlaxDPMSolverMultistepScheduler,
}


def for_kind(kind: str, config: SchedulerConfig) -> FlaxScheduler:
    """The stand-in that runs `kind` on `config`: a folder's own scheduler, as the old pipelines loaded it."""
    return STAND_INS[kind](config, **({"use_karras_sigmas": True} if kind == "dpm++2m_karras" else {}))


# Old Flax schedulers with no counterpart here, and what to use instead.
GONE_SCHEDULERS = {
    "FlaxLMSDiscreteScheduler": "FlaxEulerDiscreteScheduler (LMS is not among our schedulers)",
    "FlaxDDPMScheduler": "FlaxDDIMScheduler (ancestral DDPM sampling is not among our schedulers)",
    "FlaxKarrasVeScheduler": "FlaxEulerDiscreteScheduler",
    "FlaxScoreSdeVeScheduler": "FlaxEulerDiscreteScheduler",
}
