"""The safety checker equals diffusers' `StableDiffusionSafetyChecker` behind transformers' `CLIPImageProcessor`.

Tiny random checkers written with `save_pretrained`, whose concept embeddings and thresholds are
aimed at the test pictures so that one is flagged by a concept, one only through the special-care
adjustment, one passes a special-care threshold without being flagged, and the rest are clean.
diffusers' own scores are read as it computes them (its `round` and `cosine_distance` are
recorded), so nothing of its loop is re-implemented here.
"""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.pipelines.stable_diffusion import safety_checker as torch_safety
from flax import nnx
from PIL import Image
from reference import randomize, rel_error
from safetensors.numpy import load_file, save_file
from transformers import CLIPConfig
from transformers import CLIPImageProcessorPil as TorchImageProcessor

from engine.errors import ConfigError, WeightsError
from engine.loading.safety import load_safety_checker
from engine.loading.sources import select_hub_files
from engine.models.config import FeatureExtractorConfig, SafetyCheckerConfig
from engine.models.safety import SafetyChecker, check, pil_bicubic_resize, preprocess

TOL = 1e-4
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=8)
# Picture size (h, w), the processor's config as the file writes it, and the checker's image_size.
CASES = {
    "shrink": ((64, 64), dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}), 32),
    # Older folders write plain ints (SD 1.5's file: "size": 224, "crop_size": 224); this one crops too.
    "wide-crop-legacy": ((48, 64), dict(size=40, crop_size=32), 32),
    "tall-enlarge": ((40, 32), dict(size={"shortest_edge": 48}, crop_size={"height": 48, "width": 48}), 48),
}
EXPECTED_FLAGS = [True, True, False, False, False, False]


def pictures(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth random pictures [n, H, W, 3] in [0, 1], like a decoder's, not white noise."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0, 1, (n, max(height // 8, 2), max(width // 8, 2), 3))
    x = np.asarray(jax.image.resize(base, (n, height, width, 3), "linear")) + rng.normal(0, 0.05, (n, height, width, 3))
    return np.clip(x, 0, 1).astype(np.float32)


def to_pil(images: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray((x * 255).round().astype(np.uint8)) for x in images]  # diffusers' numpy_to_pil


def run_diffusers(checker, pixel_values: torch.Tensor, monkeypatch) -> dict:
    """diffusers' forward, with the cosines and rounded scores it computes along the way."""
    cosines, rounded = [], []
    original = torch_safety.cosine_distance

    def recording_cosine(a, b):
        out = original(a, b)
        cosines.append(out.double().numpy())
        return out

    def recording_round(value, digits):
        out = builtins.round(value, digits)
        rounded.append(out)
        return out

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(torch_safety, "cosine_distance", recording_cosine)
        patch.setattr(torch_safety, "round", recording_round, raising=False)
        _, flags = checker(pixel_values, np.zeros((len(pixel_values), 1, 1, 3)))
    scores = np.asarray(rounded, np.float32).reshape(len(pixel_values), -1)  # each: 3 special-care, 17 concepts
    return dict(
        special_cos=cosines[0], concept_cos=cosines[1], special=scores[:, :3], concept=scores[:, 3:], flags=flags
    )


def aim_concepts(checker, embeds: np.ndarray) -> None:
    """Concept embeddings and thresholds that give `EXPECTED_FLAGS` for pictures with these embeddings.

    A tiny random tower embeds every picture nearly alike (cosines ~0.99), so an aimed concept is
    the direction that has a positive dot product with one picture's embedding and none with the
    others' (the least-norm solution of embeds @ c = one-hot).
    """
    rng = np.random.default_rng(1)
    aimed = lambda picture: np.linalg.lstsq(embeds, np.eye(len(embeds))[picture], rcond=None)[0]  # noqa: E731
    concepts, special = rng.normal(size=(17, embeds.shape[1])), rng.normal(size=(3, embeds.shape[1]))
    concepts[0], concepts[2] = aimed(0), aimed(1)  # picture 0 by concept 0; picture 1 by concept 2, see below
    special[0], special[1] = aimed(2), aimed(1)  # picture 2 and picture 1 pass a special-care threshold
    unit = lambda v: v / np.linalg.norm(v, axis=-1, keepdims=True)  # noqa: E731
    cos_c, cos_s = unit(embeds) @ unit(concepts).T, unit(embeds) @ unit(special).T
    thresholds_c = cos_c.max(0) + rng.uniform(0.03, 0.3, 17)  # never passed; the scores spread out
    thresholds_s = cos_s.max(0) + rng.uniform(0.03, 0.3, 3)
    # Midway between the picture's cosine and the others' (0): far from both, with the 0.01 adjustment too.
    assert min(cos_c[0, 0], cos_c[1, 2], cos_s[2, 0], cos_s[1, 1]) > 0.03
    thresholds_c[0], thresholds_s[0], thresholds_s[1] = cos_c[0, 0] / 2, cos_s[2, 0] / 2, cos_s[1, 1] / 2
    thresholds_c[2] = cos_c[1, 2] + 0.005  # picture 1 is flagged only by the 0.01 its special care adds
    with torch.no_grad():
        for name, value in [
            ("concept_embeds", concepts),
            ("special_care_embeds", special),
            ("concept_embeds_weights", thresholds_c),
            ("special_care_embeds_weights", thresholds_s),
        ]:
            getattr(checker, name).copy_(torch.from_numpy(value))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """A diffusers folder with a tiny aimed checker, the torch checker and processor, and the pictures."""
    (height, width), processor_config, image_size = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    cfg = CLIPConfig(vision_config=dict(VISION, image_size=image_size), projection_dim=24)
    checker = randomize(torch_safety.StableDiffusionSafetyChecker(cfg), seed=0)
    processor = TorchImageProcessor(**processor_config)
    images = pictures(len(EXPECTED_FLAGS), height, width)
    pixel_values = processor(to_pil(images), return_tensors="pt").pixel_values
    with torch.no_grad():
        aim_concepts(checker, checker.visual_projection(checker.vision_model(pixel_values)[1]).numpy())
    checker.save_pretrained(folder / "safety_checker")
    (folder / "feature_extractor").mkdir()
    feature_config = {"feature_extractor_type": "CLIPFeatureExtractor", "resample": 3, **processor_config}
    (folder / "feature_extractor" / "preprocessor_config.json").write_text(json.dumps(feature_config))
    (folder / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "StableDiffusionPipeline",
                "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
                "feature_extractor": ["transformers", "CLIPImageProcessor"],
            }
        )
    )
    return dict(folder=folder, checker=checker.eval(), images=images, pixel_values=pixel_values)


def our_cosines(loaded, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    model: SafetyChecker = nnx.merge(loaded.graphdef, loaded.params)
    embeds = np.asarray(nnx.jit(SafetyChecker.image_embeds)(model, jnp.asarray(pixel_values)), np.float64)
    unit = lambda v: v / np.linalg.norm(v, axis=-1, keepdims=True)  # noqa: E731
    return (
        unit(embeds) @ unit(np.asarray(model.special_care_embeds[...], np.float64)).T,
        unit(embeds) @ unit(np.asarray(model.concept_embeds[...], np.float64)).T,
    )


def assert_same_rounded_scores(got, want: np.ndarray, unrounded: np.ndarray) -> None:
    """diffusers' `round(score, 3)`: the same thousandths, to the last bit of the division by 1000 (XLA
    multiplies by a reciprocal), except one step apart for a score within 1e-5 of a rounding boundary
    (a 1e-7 difference decides those; the 0.01 adjustment moves no score nearer to one)."""
    off = np.abs(np.asarray(got, np.float64) - want)
    near_boundary = np.abs(np.abs(unrounded * 1000) % 1 - 0.5) < 0.01
    assert np.all((off <= 1e-6 * np.abs(want)) | (near_boundary & (off <= 1e-3 + 1e-6)))


def assert_same_as_diffusers(loaded, pixel_values: np.ndarray, got, want: dict) -> None:
    special_cos, concept_cos = our_cosines(loaded, pixel_values)
    assert rel_error(special_cos, want["special_cos"]) < TOL
    assert rel_error(concept_cos, want["concept_cos"]) < TOL
    thresholds = {k: np.asarray(loaded.params[k][...], np.float64) for k in loaded.params if k.endswith("_weights")}
    assert_same_rounded_scores(
        got.special_scores, want["special"], special_cos - thresholds["special_care_embeds_weights"]
    )
    assert_same_rounded_scores(got.concept_scores, want["concept"], concept_cos - thresholds["concept_embeds_weights"])
    assert np.asarray(got.has_nsfw_concepts).tolist() == want["flags"] == EXPECTED_FLAGS


def test_same_scores_and_flags_from_the_same_pixel_values(case, monkeypatch):
    # The model alone: diffusers' processor output fed to both checkers.
    want = run_diffusers(case["checker"], case["pixel_values"], monkeypatch)
    loaded = load_safety_checker(case["folder"])
    nhwc = case["pixel_values"].numpy().transpose(0, 2, 3, 1)
    got = jax.jit(lambda p, x: nnx.merge(loaded.graphdef, p)(x))(loaded.params, jnp.asarray(nhwc))
    assert_same_as_diffusers(loaded, nhwc, got, want)


def test_same_scores_and_flags_from_the_decoded_pictures(case, monkeypatch):
    # The whole path: our on-device preprocessing of the [0, 1] pictures, against diffusers' uint8
    # PIL pictures through CLIPImageProcessor (its PIL backend, what transformers uses without torchvision).
    want = run_diffusers(case["checker"], case["pixel_values"], monkeypatch)
    loaded = load_safety_checker(case["folder"])
    images = jnp.asarray(case["images"])
    got = jax.jit(check, static_argnums=0)(loaded.graphdef, loaded.params, images)
    ours = np.asarray(preprocess(loaded.feature_extractor, images))
    theirs = case["pixel_values"].numpy().transpose(0, 2, 3, 1)
    assert np.abs(ours - theirs).max() < 1e-5  # PIL's resize to the bit; f32 rounding in the rescale
    assert_same_as_diffusers(loaded, ours, got, want)


@pytest.mark.parametrize(
    ("size", "out"),
    [((512, 512), (224, 224)), ((96, 128), (224, 298)), ((64, 48), (298, 224)), ((37, 91), (40, 98))],
)
def test_the_resize_is_pils_bicubic_to_the_bit(size, out):
    images = (pictures(2, *size, seed=3) * 255).round().astype(np.uint8)
    images[0, :3], images[0, 3:6] = 255, 0  # a hard edge: PIL clips the overshoot of its first pass
    want = np.stack([np.asarray(Image.fromarray(x).resize(out[::-1], Image.BICUBIC)) for x in images])
    got = np.asarray(pil_bicubic_resize(jnp.asarray(images, jnp.float32), *out))
    np.testing.assert_array_equal(got, want)


def tiny_folder(folder: Path, edit=None, index_entry=("stable_diffusion", "StableDiffusionSafetyChecker")) -> Path:
    """A diffusers folder with a tiny random checker; `edit` changes its tensors before they are written."""
    cfg = CLIPConfig(vision_config=dict(VISION, image_size=32), projection_dim=24)
    randomize(torch_safety.StableDiffusionSafetyChecker(cfg)).save_pretrained(folder / "safety_checker")
    weights = folder / "safety_checker" / "model.safetensors"
    if edit is not None:
        save_file(edit(load_file(weights)), weights)
    (folder / "feature_extractor").mkdir()
    (folder / "feature_extractor" / "preprocessor_config.json").write_text(json.dumps({"size": 32, "crop_size": 32}))
    index = {"_class_name": "StableDiffusionPipeline", "safety_checker": list(index_entry)}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_tensors_that_do_not_fit_are_refused_by_name(tmp_path):
    def edit(tensors):
        del tensors["concept_embeds_weights"]
        tensors["special_care_embeds"] = np.zeros((4, 24), np.float32)  # diffusers has 3
        tensors["vision_model.extra.weight"] = np.zeros(3, np.float32)
        return tensors

    with pytest.raises(WeightsError) as err:
        load_safety_checker(tiny_folder(tmp_path, edit))
    message = str(err.value)
    assert "missing (1): concept_embeds_weights" in message
    assert "mis-shaped (1): special_care_embeds: checkpoint (4, 24)" in message
    assert "unexpected (1): vision_model.extra.weight" in message


def test_transformers_4_and_5_key_layouts_load_alike(tmp_path):
    # SD 1.x folders were saved by transformers 4 (vision_model.vision_model.*); transformers 5 drops the inner one.
    def transformers_4(tensors):
        return {("vision_model." + k if k.startswith("vision_model.") else k): v for k, v in tensors.items()}

    new = load_safety_checker(tiny_folder(tmp_path / "5"))
    old = load_safety_checker(tiny_folder(tmp_path / "4", transformers_4))
    assert jax.tree.all(jax.tree.map(np.array_equal, new.params, old.params))


@pytest.mark.parametrize("index_entry", [None, (None, None)])
def test_a_folder_without_a_checker_has_none(tmp_path, index_entry):
    folder = tiny_folder(tmp_path)
    if index_entry is None:
        shutil.rmtree(folder / "safety_checker")
    else:  # diffusers' way of saving a pipeline with safety_checker=None
        (folder / "model_index.json").write_text(
            json.dumps({"_class_name": "StableDiffusionPipeline", "safety_checker": list(index_entry)})
        )
    assert load_safety_checker(folder) is None


def test_the_tower_runs_in_the_run_dtype_and_the_thresholds_stay_f32(tmp_path):
    loaded = load_safety_checker(tiny_folder(tmp_path), dtype="bfloat16")
    assert loaded.params["vision_model"]["vision_model"]["pre_layrnorm"]["scale"][...].dtype == jnp.bfloat16
    for name in ("concept_embeds", "special_care_embeds", "concept_embeds_weights", "special_care_embeds_weights"):
        assert loaded.params[name][...].dtype == np.float32
    result = jax.jit(check, static_argnums=0)(loaded.graphdef, loaded.params, jnp.asarray(pictures(2, 64, 64)))
    assert result.concept_scores.dtype == jnp.float32 and result.has_nsfw_concepts.shape == (2,)


def test_a_legacy_vision_config_dict_replaces_the_vision_config():
    # transformers: `vision_config_dict` wins, and the keys it leaves out take CLIPVisionConfig's defaults.
    raw = {
        "model_type": "clip",
        "projection_dim": 768,
        "vision_config": {"hidden_size": 1, "patch_size": 1, "image_size": 7},
        "vision_config_dict": {"hidden_size": 1024, "num_attention_heads": 16, "patch_size": 14},
        "text_config_dict": {"hidden_size": 768},
    }
    vision = SafetyCheckerConfig.from_dict(raw).vision_config
    assert (vision.hidden_size, vision.patch_size, vision.image_size, vision.num_positions) == (1024, 14, 224, 257)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"resample": 2}, "resample 2 is not supported"),
        ({"size": {"height": 224, "width": 224}}, "only shortest_edge"),
        ({"size": 224, "crop_size": 256}, "larger than the resized shortest edge"),
    ],
)
def test_a_preprocessing_we_do_not_do_is_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        FeatureExtractorConfig.from_dict(raw)


def test_the_checker_files_are_fetched_only_when_asked_for():
    files = [
        "model_index.json",
        "feature_extractor/preprocessor_config.json",
        "safety_checker/config.json",
        "safety_checker/model.safetensors",
        "safety_checker/model.fp16.safetensors",
        "safety_checker/pytorch_model.bin",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
    ]
    checker_files = {"feature_extractor/preprocessor_config.json", "safety_checker/config.json"}
    assert not {f for f in select_hub_files(files) if f.startswith(("safety", "feature"))}
    full = set(select_hub_files(files, safety_checker=True))
    assert checker_files | {"safety_checker/model.safetensors"} <= full
    assert "safety_checker/model.fp16.safetensors" not in full and "safety_checker/pytorch_model.bin" not in full
    fp16 = set(select_hub_files(files, "fp16", safety_checker=True))
    assert checker_files | {"safety_checker/model.fp16.safetensors"} <= fp16
