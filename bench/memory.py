"""What Z-Image-Turbo and FLUX.2 [klein] 4B hold in memory on a CPU, measured: a folder at the published shapes
with random bf16 weights (the Hub is not reachable from here; a load's and a picture's memory depend on the shapes,
not on the values), loaded as the app loads it and drawing one picture.

    python bench/memory.py --write /tmp/klein --model klein-4b      # ~16 GB of safetensors, shards of 5 GB
    python bench/memory.py --measure /tmp/klein --quantize int8 --size 512 --steps 1 --pictures 2

`--write` builds each component's state-dict names and shapes on PyTorch's meta device (diffusers' and transformers'
own classes, nothing drawn), then streams random bf16 values into safetensors shards one tensor at a time (a block of
normal values tiled to each tensor's size: linears and convolutions N(0, 1/fan_in), norms 1 + N(0, 0.1), biases
N(0, 0.01), embeddings N(0, 1), batch-norm variances 1), so writing never holds more than one tensor. The configs are
`tools/published_configs.py`'s; the tokenizer is the tests' offline Qwen tokenizer (a few hundred tokens: the
embedding keeps Qwen3-4B's 151936 rows). Only what the engine loads: transformer, text_encoder, vae, tokenizer,
scheduler, model_index.json.

`--measure` runs the load and the picture in a process of its own, without torch, set up as app.py sets it up
(`pair_cores`, `keep_freed_memory`, `load_pipeline` with the app's automatic dtype), and prints one JSON line: peak
resident memory (`ru_maxrss` and /proc/self/status VmHWM) and resident memory now (VmRSS, and its parts RssAnon and
RssFile) after the load and after the picture; the peaks of RssAnon (the process's own memory) and RssFile (mapped
safetensors pages, clean page cache that the system drops under pressure, but which VmHWM counts) sampled every
0.5 s; the wall seconds of each (the picture's include compiling its programs), the CPU and its vector flags, and
the 1-minute load average (the cores are shared: times are loaded-cores figures). This process watches the
machine's MemAvailable and stops the measured one if it falls under `--floor-gb`, saying so, so that a model too
large for the machine never pushes its other processes out. GB is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODELS = {"z-image-turbo": "Tongyi-MAI/Z-Image-Turbo", "klein-4b": "black-forest-labs/FLUX.2-klein-4B"}
SHARD_BYTES = 5_000_000_000  # transformers' and diffusers' save_pretrained max_shard_size
BLOCK = 1 << 22  # random values drawn once and tiled


# -- writing ------------------------------------------------------------------------------------------------------
def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], str]], values) -> None:
    """A safetensors file of `tensors` (name, shape, "BF16" or "I64"), each one's bytes from `values(name, shape,
    dtype)` written as made: the header first (its offsets known from the shapes), then each tensor's data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in tensors:
        size = math.prod(shape) * (2 if dtype == "BF16" else 8)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape, dtype in tensors:
            f.write(values(name, shape, dtype).tobytes())


def random_values(seed: int = 0):
    """values(name, shape, dtype) for `write_safetensors`: a tiled block of N(0, 1) values scaled by the tensor's
    kind (see the module's docstring), as bf16 (int64 buffers as zeros)."""
    import ml_dtypes

    block = np.random.default_rng(seed).standard_normal(BLOCK, dtype=np.float32)
    cache: dict[tuple[float, float], np.ndarray] = {}

    def values(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        if dtype == "I64":
            return np.zeros(shape, np.int64)
        if name.endswith("running_var"):
            shift, scale = 1.0, 0.0
        elif len(shape) == 1:
            norm = "norm" in name or name.endswith(("ln.weight", "scale")) or "bn." in name
            shift, scale = (1.0, 0.1) if norm and name.endswith(("weight", "scale")) else (0.0, 0.01)
        elif "embed_tokens" in name:
            shift, scale = 0.0, 1.0
        else:
            shift, scale = 0.0, 1.0 / math.sqrt(math.prod(shape[1:]))
        if (shift, scale) not in cache:
            cache[shift, scale] = (shift + scale * block).astype(ml_dtypes.bfloat16)
        tiled = cache[shift, scale]
        count = math.prod(shape)
        return np.resize(tiled, count).reshape(shape) if count > BLOCK else tiled[:count].reshape(shape)

    return values


def state_shapes(module) -> list[tuple[str, tuple[int, ...], str]]:
    """A meta-device module's saved tensors: (name, shape, safetensors dtype), a tied weight once (as saved)."""
    seen, rows = set(), []
    for name, tensor in module.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.shape) if tensor.device.type != "meta" else None
        tied = name == "lm_head.weight" and getattr(module.config, "tie_word_embeddings", False)
        if tied or (key is not None and key in seen):
            continue
        seen.add(key)
        rows.append((name, tuple(tensor.shape), "BF16" if tensor.dtype.is_floating_point else "I64"))
    return rows


def write_weights(folder: Path, stem: str, rows: list, values) -> list[str]:
    """`rows` in shards of at most SHARD_BYTES, named as save_pretrained names them (`stem`.safetensors, or
    `stem`-0000i-of-0000n.safetensors and an index); returns the files."""
    shards, current, size = [], [], 0
    for row in rows:
        nbytes = math.prod(row[1]) * (2 if row[2] == "BF16" else 8)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(row)
        size += nbytes
    shards.append(current)
    names = (
        [f"{stem}.safetensors"]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(folder / name, shard, values)
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": {r[0]: n for n, s in zip(names, shards, strict=True) for r in s}}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def write_model(folder: Path, model: str, configs: dict | None = None) -> dict[str, float]:
    """The model's folder at `configs` (default: its published ones) with random weights; GB written a component."""
    import diffusers
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from qwen_reference import save_tiny_qwen_tokenizer  # the tests' offline Qwen tokenizer

    from tools.published_configs import PUBLISHED

    configs = configs or PUBLISHED[MODELS[model]]
    values, written = random_values(), {}
    causal = model == "klein-4b"
    for name in ("transformer", "vae"):
        config = {k: v for k, v in configs[name].items() if k != "_class_name"}
        with torch.device("meta"):
            module = getattr(diffusers, configs[name]["_class_name"])(**config)
        module.save_config(folder / name)
        written[name] = sum(math.prod(r[1]) * 2 for r in state_shapes(module)) / 1e9
        write_weights(folder / name, "diffusion_pytorch_model", state_shapes(module), values)
        del module
    text = {k: v for k, v in configs["text_encoder"].items() if k not in ("architectures", "model_type")}
    qwen = transformers.Qwen3Config(**text)
    with torch.device("meta"):
        module = (transformers.Qwen3ForCausalLM if causal else transformers.Qwen3Model)(qwen)
    module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(folder / "text_encoder")
    written["text_encoder"] = sum(math.prod(r[1]) * 2 for r in state_shapes(module)) / 1e9
    write_weights(folder / "text_encoder", "model", state_shapes(module), values)
    save_tiny_qwen_tokenizer(folder / "tokenizer")
    scheduler = configs["scheduler"]
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2))
    index = dict(configs["model_index.json"])
    index.update(
        scheduler=["diffusers", scheduler["_class_name"]],
        text_encoder=["transformers", type(module).__name__],
        tokenizer=["transformers", "Qwen2Tokenizer"],
        transformer=["diffusers", configs["transformer"]["_class_name"]],
        vae=["diffusers", configs["vae"]["_class_name"]],
    )
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return written


# -- measuring ----------------------------------------------------------------------------------------------------
def status_gb(pid: int | str = "self") -> dict[str, float]:
    """A process's /proc status memory lines, in GB: VmHWM (peak resident), VmRSS (resident now) and its two parts,
    RssAnon (its own memory) and RssFile (pages of mapped files: here the safetensors, which the system can drop)."""
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            status[key] = int(value.split()[0]) * 1024 / 1e9
    return status


def memory_now() -> dict[str, float]:
    """This process's peak resident memory (ru_maxrss, VmHWM: both count mapped file pages) and resident memory now
    (VmRSS, of it RssAnon and RssFile), in GB."""
    status = status_gb()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return {"maxrss_gb": round(maxrss, 2), **{f"{k.lower()}_gb": round(v, 2) for k, v in status.items()}}


def measured(folder: Path, quantize: str | None, size: int, steps: int, pictures: int = 1) -> dict:
    """In this process, which must not have started JAX: the app's set-up, the load, one picture."""
    import logging

    import engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the phases, on stderr
    Path("/proc/self/oom_score_adj").write_text("1000")  # if memory runs out, the kernel stops this process first
    engine.pair_cores(None)
    engine.keep_freed_memory()
    started = time.perf_counter()
    pipe = engine.load_pipeline(folder, None, quantize=quantize, safety_checker=False)
    loaded = time.perf_counter()
    after_load = {"dtype": pipe.dtype, "load_s": round(loaded - started, 1), "after_load": memory_now()}
    print(json.dumps(after_load), flush=True)  # kept should the picture not finish
    if steps == 0:  # the load alone
        return after_load
    result = pipe.generate("a photo of a cat", height=size, width=size, num_inference_steps=steps, seed=0)
    drawn = time.perf_counter()
    again = []  # the same request's later pictures: nothing left to compile
    for seed in range(1, pictures):
        begun = time.perf_counter()
        pipe.generate("a photo of a cat", height=size, width=size, num_inference_steps=steps, seed=seed)
        again.append(round(time.perf_counter() - begun, 1))
    return {
        **after_load,
        "devices": [str(d) for d in pipe.devices],
        "picture_s": round(drawn - loaded, 1),
        "later_pictures_s": again,
        "timings": {k: round(v, 1) for k, v in result.timings.items()},
        "after_picture": memory_now(),
        "picture_std": round(float(np.asarray(result.images[0], np.float32).std()), 2),
        "modules": sorted(m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("torch", "diffusers")),
    }


def measure(folder: Path, quantize: str | None, size: int, steps: int, floor_gb: float, pictures: int = 1) -> dict:
    """`measured` in a fresh process, watched: stopped if the machine's MemAvailable falls under `floor_gb`."""
    from picture import cpu_header

    command = [sys.executable, __file__, "--child", str(folder), "--size", str(size), "--steps", str(steps)]
    command += ["--pictures", str(pictures)]
    command += ["--quantize", quantize] if quantize else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    lowest, stopped, peaks = float("inf"), False, {"RssAnon": 0.0, "RssFile": 0.0}
    while child.poll() is None:
        available = available_gb()
        lowest = min(lowest, available)
        try:
            peaks = {k: max(v, status_gb(child.pid).get(k, 0.0)) for k, v in peaks.items()}
        except OSError:  # it has just ended
            pass
        if available < floor_gb:
            child.kill()
            stopped = True
        time.sleep(0.5)
    out = child.stdout.read().strip().splitlines()
    report = {}
    for line in out:  # the load's line, then the whole report
        report.update(json.loads(line) if line.startswith("{") else {})
    if child.returncode:
        report["error"] = f"exit status {child.returncode}"
    if stopped:
        report["error"] = f"stopped: the machine's available memory fell under {floor_gb} GB"
    name = json.loads((folder / "model_index.json").read_text())["_class_name"]
    return {
        "model": name,
        "quantize": quantize,
        "size": size,
        "steps": steps,
        **report,
        "sampled_peak_anon_gb": round(peaks["RssAnon"], 2),  # every 0.5 s: the process's own memory
        "sampled_peak_file_gb": round(peaks["RssFile"], 2),
        "lowest_available_gb": round(lowest, 2),
        "load_average_1m": os.getloadavg()[0],
        "cpu": cpu_header("native").lstrip("# "),
    }


def available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write a folder at the published shapes here")
    parser.add_argument("--model", choices=sorted(MODELS), help="with --write")
    parser.add_argument("--measure", type=Path, help="load this folder and draw one picture, in a fresh process")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quantize", choices=("int8", "w8a8"), default=None)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=1, help="0: the load alone, no picture")
    parser.add_argument("--pictures", type=int, default=1, help="pictures drawn; the first compiles its programs")
    parser.add_argument(
        "--floor-gb", type=float, default=0.5, help="stop the measured process under this much available memory"
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measured(args.child, args.quantize, args.size, args.steps, args.pictures)), flush=True)
    elif args.write:
        if not args.model:
            parser.error("--write needs --model")
        started = time.perf_counter()
        written = write_model(args.write, args.model)
        print(json.dumps({"written_gb": written, "seconds": round(time.perf_counter() - started, 1)}))
    elif args.measure:
        print(json.dumps(measure(args.measure, args.quantize, args.size, args.steps, args.floor_gb, args.pictures)))
    else:
        parser.error("--write DIR --model NAME, or --measure DIR")


if __name__ == "__main__":
    main()
