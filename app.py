"""jax-sd web demo: the command line that loads the engine and serves the web app (web/) over it.

The page, its API and the request parsing live in `web/`; everything that touches the model lives in
`engine/`. The model comes from the server's configuration (`--model` or `MODEL_ID`), never from the page.

    python app.py                                   # embedded default model, 127.0.0.1:7860
    python app.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --host 0.0.0.0
    python app.py --model FOLDER --controlnet lllyasviel/sd-controlnet-canny --lora style=style.safetensors

A Hugging Face Space runs this file as it is: its GRADIO_SERVER_NAME and GRADIO_SERVER_PORT pick the address.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

# transformers (the tokenizers) advises installing PyTorch on import; the app does not need it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import engine  # noqa: E402
import web  # noqa: E402
from web import API_NAME, THEME, create_demo, read_auth  # noqa: E402, F401 - the page's names, importable from here too

log = logging.getLogger("jax-sd")

MAX_IMAGES_PER_DEVICE = engine.Limits.max_images_per_device


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="jax-sd web demo")
    parser.add_argument(
        "--model",
        default=os.environ.get("MODEL_ID") or None,
        help="Hub id, local diffusers folder, or a single-file checkpoint (FILE.safetensors or .ckpt in the original "
        "SD 1.x / 2.x / SDXL layout; a FLUX.1 or SD 3 transformer .safetensors or .gguf; env MODEL_ID); default: the "
        "embedded model",
    )
    parser.add_argument(
        "--models",
        default=os.environ.get("JAX_SD_MODELS") or None,
        help="a models folder in A1111's layout (env JAX_SD_MODELS): every checkpoint of its Stable-diffusion/ "
        "(single files and diffusers folders) is served and a request may name one; Lora/ is called from prompts, "
        "embeddings/, ESRGAN/ and RealESRGAN/ serve every model. --model then names the default",
    )
    parser.add_argument(
        "--max-loaded-models",
        type=int,
        default=engine.DEFAULT_MAX_LOADED,
        help="with --models: models held in memory at once; another is loaded on demand once the least recently "
        "used one is idle",
    )
    parser.add_argument(
        "--embeddings",
        default=None,
        help="a folder of textual inversion embeddings (A1111's embeddings/: .pt, .safetensors), each called in a "
        "prompt by its file's name",
    )
    parser.add_argument(
        "--upscalers",
        default=None,
        help="a folder of upscaler networks (ESRGAN, Real-ESRGAN, 4x-UltraSharp, ...: .pth or .safetensors), offered "
        "beside Lanczos and Nearest to hires fix and A1111's Extras",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="for a single-file --model: the diffusers folder or Hub id of the same kind whose configs, tokenizers and "
        "scheduler it uses (default: the Hub repo diffusers uses for its kind)",
    )
    parser.add_argument(
        "--prediction-type",
        choices=("epsilon", "v_prediction"),
        default=None,
        help="for a single-file --model: what its UNet predicts (SD 2.x 768 files: v_prediction), over a .yaml "
        "beside the file and the config's scheduler",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="address to bind (default 127.0.0.1; 0.0.0.0 to serve the network)",
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    parser.add_argument("--queue-size", type=int, default=48, help="requests waiting at most; more are refused")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=engine.DEFAULT_MAX_BATCH_SIZE,
        help="pictures drawn at once over all devices (rounded up to a multiple of the device count)",
    )
    parser.add_argument(
        "--sizes",
        default="common",
        help='sizes offered, "512x512,768x512,...", or "common" (the model\'s own and common aspect ratios)',
    )
    parser.add_argument(
        "--images-per-device", type=int, default=1, help="default images per device (the page can change it)"
    )
    parser.add_argument(
        "--auth",
        default=os.environ.get("JAX_SD_AUTH") or None,
        help='log-in for the page and its API: "user:password", several comma-separated, or a file of such '
        "lines (env JAX_SD_AUTH)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("JAX_SD_API_KEY") or None,
        help='keys for the REST APIs (A1111 /sdapi/v1, OpenAI /v1/images): "KEY", several comma-separated, or '
        '"@FILE" with one per line (env JAX_SD_API_KEY). Alone it closes only the APIs, not the page',
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=web.DEFAULT_MAX_BODY_MB,
        help="the REST APIs refuse request bodies over this many megabytes (413)",
    )
    parser.add_argument(
        "--max-picture-pixels",
        type=int,
        default=None,
        help="a picture sent in (page, REST APIs, PNG info) over this many pixels is refused from its header, before "
        "it is decoded (default: twice the largest side the model draws, squared)",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=os.environ.get("JAX_SD_ALLOWED_HOSTS") or None,
        help="host names the server answers to besides 127.0.0.1, localhost and [::1], comma-separated (env "
        "JAX_SD_ALLOWED_HOSTS). On a loopback --host, a request naming another host is refused (DNS rebinding); on "
        "0.0.0.0 nothing is checked unless names are given",
    )
    parser.add_argument(
        "--max-caller-requests",
        type=int,
        default=web.DEFAULT_MAX_REQUESTS,
        help="requests one caller (a login or API key, else a page session or an address) may have waiting or "
        "drawing at once, page and APIs together; more are refused at once (429)",
    )
    parser.add_argument(
        "--max-caller-work",
        type=int,
        default=web.DEFAULT_MAX_WORK,
        help="images x steps one caller may have waiting or drawing at once; more are refused at once (429)",
    )
    parser.add_argument(
        "--forwarded-allow-ips",
        default=os.environ.get("FORWARDED_ALLOW_IPS") or None,
        help="addresses or networks of proxies whose X-Forwarded-For names the client, comma-separated, or * (env "
        "FORWARDED_ALLOW_IPS, as uvicorn's); from anyone else the header is ignored",
    )
    parser.add_argument("--mcp", action="store_true", help="also serve /generate as an MCP tool (Gradio's MCP server)")
    parser.add_argument(
        "--no-safety-checker",
        action="store_true",
        help="do not run the model's own safety checker (for local use; a public page should keep it)",
    )
    parser.add_argument(
        "--controlnet",
        default=os.environ.get("JAX_SD_CONTROLNET") or None,
        help="a diffusers-format ControlNet folder or Hub id for the model (env JAX_SD_CONTROLNET); the page "
        "then takes a control picture",
    )
    parser.add_argument(
        "--vae",
        default=os.environ.get("JAX_SD_VAE") or None,
        help="a diffusers-format VAE folder or Hub id in place of the model's own (env JAX_SD_VAE): an AutoencoderKL "
        "(stabilityai/sd-vae-ft-mse) or a tiny AutoencoderTiny (madebyollin/taesd, taesdxl), which decodes in a "
        "fraction of the time and draws every preview as a real picture; a tiny VAE also as madebyollin/taesd's own "
        "files: one (taesd_decoder.safetensors, taef2_decoder.pth), or a folder or Hub id holding its encoder and "
        "decoder files (a decoder alone refuses image to image, inpainting and references)",
    )
    parser.add_argument(
        "--t5",
        choices=("device", "host", "off"),
        default=os.environ.get("JAX_SD_T5") or "device",
        help="where SD3's and FLUX.1's T5 text encoder runs (env JAX_SD_T5): with the other networks (device), in "
        "host memory on the CPU once per request (host: saves its 9.5 GB of bf16 on an accelerator), or not at all "
        "(off, SD3 only: zeros in its place)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default=os.environ.get("JAX_SD_DTYPE") or "auto",
        help="the networks' dtype (env JAX_SD_DTYPE): auto is bf16 on GPU/TPU and on a CPU with native bf16 where "
        "the oneDNN kernels build (Debian: libdnnl-dev), else f32",
    )
    parser.add_argument(
        "--quantize",
        choices=("int8", "w8a8"),
        default=os.environ.get("JAX_SD_QUANTIZE") or None,
        help="int8: keep the denoiser's large linear kernels as int8 with a scale per output channel (env "
        "JAX_SD_QUANTIZE): half the memory of bf16 (FLUX.1's transformer: 24 GB -> 12 GB); w8a8: compute the "
        "denoiser's linear layers and convolutions in int8 (activations quantized per call; on an AVX2 CPU about "
        "twice f32's speed, pictures near f32's); not with --lora",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a LoRA (.safetensors file, folder or Hub id) under a name; repeat for several. The page shows a "
        "weight slider for each",
    )
    args = parser.parse_args(argv)
    loras = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            parser.error(f"--lora {item!r} is not NAME=PATH")
        if name.strip() in loras:
            parser.error(f"--lora: the name {name.strip()!r} is given twice")
        loras[name.strip()] = path.strip()
    if not 1 <= args.images_per_device <= MAX_IMAGES_PER_DEVICE:
        parser.error(f"--images-per-device must be from 1 to {MAX_IMAGES_PER_DEVICE}")
    if args.queue_size < 1:
        parser.error("--queue-size must be at least 1")
    if args.max_batch_size < 1:
        parser.error("--max-batch-size must be at least 1")
    sizes = args.sizes
    if sizes != "common":
        try:
            sizes = [tuple(int(v) for v in item.strip().lower().split("x")) for item in sizes.split(",")]
            assert all(len(pair) == 2 for pair in sizes)
        except (ValueError, AssertionError):
            parser.error('--sizes must be "common" or a list like "512x512,768x512"')
    if args.dtype not in ("auto", "float32", "bfloat16"):  # from JAX_SD_DTYPE
        parser.error(f"--dtype (env JAX_SD_DTYPE) must be auto, float32 or bfloat16, not {args.dtype!r}")
    if args.quantize not in (None, "int8", "w8a8"):  # from JAX_SD_QUANTIZE: argparse checks only the command line
        parser.error(f"--quantize (env JAX_SD_QUANTIZE) must be int8 or w8a8, not {args.quantize!r}")
    if args.max_body_mb <= 0:
        parser.error("--max-body-mb must be above 0")
    if args.max_picture_pixels is not None and args.max_picture_pixels <= 0:
        parser.error("--max-picture-pixels must be above 0")
    if args.max_loaded_models < 1:
        parser.error("--max-loaded-models must be at least 1")
    if args.models and loras:
        parser.error("--lora and --models: put the LoRA in the models folder's Lora/ and call it from the prompt")
    if args.max_caller_requests < 1 or args.max_caller_work < 1:
        parser.error("--max-caller-requests and --max-caller-work must be at least 1")
    try:
        auth = read_auth(args.auth)
        api_keys = web.read_api_keys(args.api_key)
        extra_hosts = web.read_allowed_hosts(args.allowed_hosts)
        proxies = web.read_forwarded_allow_ips(args.forwarded_allow_ips)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    # Our own progress lines; other libraries only when something is wrong (no backend-probing chatter).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)

    dtype = None if args.dtype == "auto" else args.dtype
    # two CPU devices per image on a CPU host (engine/sampling/pairs.py), before JAX starts
    engine.pair_cores(dtype, int8=args.quantize == "w8a8")
    engine.keep_freed_memory()  # XLA's CPU temporaries reused, not mapped afresh at every call (before JAX starts)
    engine.enable_compile_cache()
    started = time.perf_counter()
    options = dict(
        dtype=dtype,
        max_batch_size=args.max_batch_size,
        sizes=sizes,
        safety_checker=not args.no_safety_checker,
        controlnet=args.controlnet,
        vae=args.vae,
        quantize=args.quantize,
        t5=args.t5,
        config=args.config,
        prediction_type=args.prediction_type,
        embeddings=args.embeddings,
        upscalers=args.upscalers,
    )
    if args.models:  # several models, loaded on demand (engine/serving/model_pool.py); the default one now
        pipe = engine.load_models(args.models, default=args.model, max_loaded=args.max_loaded_models, **options)
        log.info("models: %s (at most %d loaded at once)", ", ".join(pipe.models.titles()), args.max_loaded_models)
    else:
        pipe = engine.load_pipeline(args.model, loras=loras, **options)
    log.info("loaded %s on %s in %.1f s", pipe.model_name, pipe.devices, time.perf_counter() - started)
    pipe.start_warmup(num_images=args.images_per_device * len(pipe.devices))
    web_app = web.build_app(
        pipe,
        images_per_device=args.images_per_device,
        queue_size=args.queue_size,
        auth=auth,
        mcp=args.mcp,
        api_keys=api_keys,
        max_body_mb=args.max_body_mb,
        max_picture_pixels=args.max_picture_pixels,
        max_caller_requests=args.max_caller_requests,
        max_caller_work=args.max_caller_work,
        forwarded_allow_ips=proxies,
        # A share link's tunnel reaches the server under the link's name: public already, so no names checked.
        allowed_hosts=None if args.share and not extra_hosts else web.allowed_hosts(args.host, extra_hosts),
    )
    web.serve(web_app, server_name=args.host, server_port=args.port, share=args.share)


if __name__ == "__main__":
    main()
