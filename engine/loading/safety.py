"""A model folder's safety checker (`safety_checker/`, `feature_extractor/`) -> a `LoadedSafetyChecker`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from ..models.config import FeatureExtractorConfig, SafetyCheckerConfig
from ..models.safety import SafetyChecker
from .sources import ModelFolder, resolve
from .weights import convert, read_safetensors


@dataclass
class LoadedSafetyChecker:
    graphdef: nnx.GraphDef  # holds both configs, so it is all `check` needs besides the params
    params: nnx.State  # host numpy arrays: the vision tower in the run dtype, the concepts in f32
    config: SafetyCheckerConfig
    feature_extractor: FeatureExtractorConfig


def ships_safety_checker(folder: ModelFolder) -> bool:
    """Whether the folder has a checker that diffusers would load (model_index may list it as [null, null])."""
    entry = folder.index.get("safety_checker")
    return (folder.root / "safety_checker").is_dir() and bool(entry) and entry[0] is not None


def load_safety_checker(source: ModelFolder | str | Path, dtype: str = "float32") -> LoadedSafetyChecker | None:
    """The folder's `safety_checker/` and `feature_extractor/`, loaded strictly; None when it ships none.

    `source` is a resolved folder, or what `sources.resolve` takes (a Hub id fetches the checker's files).
    """
    variant = "fp16" if dtype in ("float16", "bfloat16") else None
    folder = source if isinstance(source, ModelFolder) else resolve(source, variant, safety_checker=True)
    if not ships_safety_checker(folder):
        return None
    cfg = SafetyCheckerConfig.from_json(folder.component("safety_checker") / "config.json")
    feature_extractor = FeatureExtractorConfig.from_json(
        folder.component("feature_extractor") / "preprocessor_config.json"
    )
    if feature_extractor.do_center_crop and feature_extractor.crop_size != (cfg.vision_config.image_size,) * 2:
        raise ValueError(
            f"{folder.name}: feature_extractor crops {feature_extractor.crop_size}, "
            f"but the safety checker takes {cfg.vision_config.image_size}x{cfg.vision_config.image_size}"
        )
    tensors = read_safetensors(folder.weight_files("safety_checker", variant))
    graphdef, params = convert(
        lambda: SafetyChecker(cfg, feature_extractor, nnx.Rngs(0)), tensors, np.float32, f"{folder.name} safety_checker"
    )
    # Only the tower runs in the run dtype: the embeddings and thresholds decide sharp comparisons.
    run_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    for name in ("vision_model", "visual_projection"):
        params[name] = jax.tree.map(lambda a: a.astype(run_dtype), params[name])
    return LoadedSafetyChecker(graphdef, params, cfg, feature_extractor)
