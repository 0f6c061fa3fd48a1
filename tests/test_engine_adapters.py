"""ControlNet and LoRA through the serving engine, against diffusers' pipelines on the same folders.

One tiny SD 1.x folder (tests/tiny_pipeline.py), a tiny random ControlNet made from its UNet, and the two
LoRA files of tests/test_lora.py (diffusers/PEFT and kohya layouts, UNet and text encoder). One engine
loads all three and `StableDiffusionControlNetPipeline` runs the same folder, with `load_lora_weights` +
`set_adapters` for the LoRAs (which adapt the UNet and the text encoder, not the ControlNet, on both sides).
Every picture shares one plan, so the suite compiles once. Same latents, f32, DDIM with guidance: max abs
pixel difference below 1e-2 on 0..1. New conditioning scales and LoRA weights compile nothing (counted).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline
from PIL import Image
from reference import randomize
from test_lora import write_loras

from engine import GenerationRequest, InvalidRequest, Ticket, load_pipeline
from engine.loading.lora import LoRAError

SIZE, STEPS, GUIDANCE = 64, 3, 6.0
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """diffusers' pipeline and ControlNet, our engine with the ControlNet and both LoRAs, the LoRA files."""
    root = tmp_path_factory.mktemp("adapters")
    pipe = tiny_pipeline.write("sd1", root / "model")
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    controlnet = randomize(
        ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=(8, 8, 16, 16)), 7, std=0.05
    )
    controlnet.save_pretrained(root / "controlnet")
    files = write_loras(pipe, root, ("text_encoder",))
    ours = load_pipeline(root / "model", controlnet=root / "controlnet", loras=files, max_batch_size=2)
    control = StableDiffusionControlNetPipeline(**{**pipe.components, "controlnet": controlnet})
    yield control, ours, files, root
    ours.close()


def latents(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4, SIZE // 8, SIZE // 8)).astype(np.float32)


def control_picture() -> Image.Image:
    """Not the output size, so both sides resize it (Lanczos)."""
    rng = np.random.default_rng(3)
    picture = np.zeros((50, 70, 3), np.uint8)
    picture[10:40, 15:55] = (255, 255, 255)
    picture[rng.random((50, 70)) < 0.05] = (255, 255, 255)
    return Image.fromarray(picture)


def generate(ours, **kwargs):
    return ours.generate(
        PROMPT,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        height=SIZE,
        width=SIZE,
        num_images=1,
        scheduler="ddim",
        latents=latents(),
        **kwargs,
    )


def reference(pipe, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            latents=torch.from_numpy(latents()),
            height=SIZE,
            width=SIZE,
            output_type="np",
            **kwargs,
        ).images


def test_controlnet_pictures_match_diffusers_at_two_scales(setup):
    control, ours, _, _ = setup
    off = {"peft": 0.0, "kohya": 0.0}  # the plain model's weights, as diffusers' ControlNet pipeline has them
    first = generate(ours, control_image=control_picture(), controlnet_conditioning_scale=0.5, lora_scales=off)
    compiled = ours.compile_count
    pictures = [first.arrays]
    for scale in (0.5, 1.5):
        want = reference(control, image=control_picture(), controlnet_conditioning_scale=scale)
        got = (
            first
            if scale == 0.5
            else generate(ours, control_image=control_picture(), lora_scales=off, controlnet_conditioning_scale=scale)
        )
        assert np.abs(got.arrays - want).max() < TOLERANCE, scale
        pictures.append(got.arrays)
    assert ours.compile_count == compiled  # a new scale is a traced value
    assert np.abs(pictures[0] - pictures[-1]).max() > 5e-2  # the scale does change the picture


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # PEFT's note on a second adapter
def test_two_loras_match_diffusers_at_two_weights_without_recompiling(setup):
    """Both layouts at once, each adapting the UNet and the text encoder."""
    pipe, ours, files, _ = setup
    weights = [(0.8, 0.5), (1.3, -0.6)]
    got = [generate(ours, control_image=control_picture(), lora_scales=dict(peft=a, kohya=b)) for a, b in weights[:1]]
    compiled = ours.compile_count
    got += [generate(ours, control_image=control_picture(), lora_scales=dict(peft=a, kohya=b)) for a, b in weights[1:]]
    assert ours.compile_count == compiled and not got[-1].compiled
    assert ours.loras.merges_compiled == 1  # one merging program for any weights
    plain = reference(pipe, image=control_picture())
    for name, path in files.items():
        pipe.load_lora_weights(path, adapter_name=name)
    try:
        for (a, b), result in zip(weights, got, strict=True):
            pipe.set_adapters(["peft", "kohya"], [a, b])
            want = reference(pipe, image=control_picture())
            assert np.abs(want - plain).max() > 5e-2  # the LoRAs do change the picture
            assert np.abs(result.arrays - want).max() < TOLERANCE, (a, b)
    finally:
        pipe.unload_lora_weights()
    assert result.request.lora_scales == {"peft": 1.3, "kohya": -0.6}


def test_a_loaded_lora_left_out_keeps_weight_one(setup):
    _, ours, _, _ = setup
    compiled = ours.compile_count
    left_out = generate(ours, control_image=control_picture(), lora_scales={"peft": 0.8})
    named = generate(ours, control_image=control_picture(), lora_scales={"peft": 0.8, "kohya": 1.0})
    assert left_out.request.lora_scales == {"peft": 0.8, "kohya": 1.0}
    np.testing.assert_array_equal(left_out.arrays, named.arrays)
    assert ours.compile_count == compiled == 1  # every picture of this file: one plan


def test_without_a_control_image_the_controlnet_stays_out_of_the_plan(setup):
    """On a server with a ControlNet, a request without a control image is plain text-to-image."""
    _, ours, _, _ = setup
    request = ours.limits.resolve(GenerationRequest(PROMPT, height=SIZE, width=SIZE), ours.defaults)
    with_image = dataclasses.replace(request, control_image=control_picture())
    assert not ours.plan(request).control and ours.plan(with_image).control
    assert ours._job(Ticket(request, []), request, ours.plan(request), ours.prompts(request)).control is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lora_scales={"styl": 0.5}), r"unknown LoRA 'styl'; this server loaded: peft, kohya"),
        (dict(lora_scales={"peft": 3.0}), r"LoRA 'peft' weight must be a number from -2 to 2"),
        (dict(lora_scales=[0.5]), r"lora_scales must map LoRA names to weights"),
        (dict(controlnet_conditioning_scale=2.5), r"controlnet_conditioning_scale must be a number from 0 to 2"),
        (dict(control_image=np.zeros((8, 8, 3))), r"control_image must be a picture \(PIL.Image\)"),
    ],
)
def test_bad_adapter_inputs_get_a_clear_error(setup, kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        generate(setup[1], **kwargs)


def test_a_server_without_adapters_refuses_their_inputs(setup, tmp_path):
    _, _, files, root = setup
    plain = load_pipeline(root / "model", previews=False)
    try:
        with pytest.raises(InvalidRequest, match=r"started without a ControlNet \(app.py --controlnet"):
            generate(plain, control_image=control_picture())
        with pytest.raises(InvalidRequest, match=r"unknown LoRA 'peft'; this server loaded none"):
            generate(plain, lora_scales={"peft": 1.0})
    finally:
        plain.close()


def test_loras_and_controlnets_for_another_model_are_refused_at_load(setup, tmp_path):
    _, _, files, root = setup
    other = tiny_pipeline.write("sd2v", tmp_path / "sd2")  # SD 2.x layout: other widths, linear projections
    with pytest.raises(LoRAError, match=r"LoRA .*peft.safetensors: its tensors do not fit this model"):
        load_pipeline(tmp_path / "sd2", loras={"peft": files["peft"]}, previews=False)
    del other
    with pytest.raises(Exception, match=r"ControlNet .* does not fit the model .*cross_attention_dim"):
        load_pipeline(tmp_path / "sd2", controlnet=root / "controlnet", previews=False)


@pytest.mark.slow
def test_the_page_takes_a_control_picture_through_its_api(setup, tmp_path):
    """The real page on this engine, in this process: a gradio_client call with a control picture (Canny
    edges on) draws what the engine draws from the picture's edge map. The same plan: nothing compiles."""
    from _app_server import free_port
    from gradio_client import Client, handle_file

    import app

    _, ours, _, _ = setup
    control_picture().save(tmp_path / "control.png")
    demo = app.create_demo(ours)
    demo.queue().launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        client = Client(demo.local_url, verbose=False, download_files=str(tmp_path / "downloads"))
        gallery, seed, _ = client.predict(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            seed=11,
            random_seed=False,
            steps=STEPS,
            guidance_scale=GUIDANCE,
            scheduler="ddim",
            size=f"{SIZE}x{SIZE}",
            images_per_device=1,
            control_image=handle_file(str(tmp_path / "control.png")),
            canny_edges=True,
            controlnet_conditioning_scale=0.7,
            lora_scales={"peft": 0.5, "kohya": 0.0},
            api_name="/generate",
        )
    finally:
        demo.close()
    want = ours.generate(
        PROMPT,
        negative_prompt=NEGATIVE,
        seed=11,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        height=SIZE,
        width=SIZE,
        num_images=1,
        scheduler="ddim",
        control_image=ours.canny_image(Image.open(tmp_path / "control.png")),
        controlnet_conditioning_scale=0.7,
        lora_scales={"peft": 0.5, "kohya": 0.0},
    )
    with Image.open(gallery[0]["image"]) as got:
        np.testing.assert_array_equal(np.asarray(got.convert("RGB")), np.asarray(want.images[0]))
    assert ours.compile_count == 1
