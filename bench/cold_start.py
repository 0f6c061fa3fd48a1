"""Cold start: from `python app.py` to the first picture, on an empty disk and with the caches kept.

Starts the app as a user would, on a free local port, reads its log until the warm-up has finished (the moment
the page says "Ready"), then asks for one picture through the app's own REST door (A1111's /sdapi/v1/txt2img on
127.0.0.1, one step), and stops it. Prints, as JSON, the seconds from the process's start to the model loaded,
to Ready and to the first picture, for each start:

- cold: an empty JAX_SD_CACHE_DIR (XLA's compiled programs) and JAX_SD_KERNEL_DIR (the oneDNN kernels, built at
  a start that wants them: --quantize w8a8, or bf16 on a CPU with it), as on a Space whose disk is not kept;
- kept: both folders as the first cold start left them, as on a restart that keeps its disk.

Each kept start also says how many programs it compiled (`programs_compiled`: cache entries it wrote or rewrote;
0 when every program, the ones that call our oneDNN handlers included, came from the disk cache). The cache's
size and file count after the first cold start, the CPU model, its vector flags, the cores, the instruction set
cap and the 1-minute load average ride along (repeat above 2: the cores are shared).

    python bench/cold_start.py                                          # the embedded model
    python bench/cold_start.py --model sd-turbo-shape --quantize w8a8   # SD-Turbo + TAESD, 512x512, as a CPU Space
    python bench/cold_start.py --model sd-turbo-shape --isa avx2        # the AVX2 class, on a machine above it
    python bench/cold_start.py --write-sd15 /tmp/sd15                   # write SD 1.5 (random weights) once, time it
    python bench/cold_start.py --model /tmp/sd15 --runs 3

`sd-turbo-shape` is bench/picture.py's `sd-turbo` (random weights of SD-Turbo's shape and a TAESD-shaped tiny
VAE, written once with diffusers under --folder, shared with picture.py); the app runs it with `--vae` the tiny
folder and is asked for 512x512.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from picture import ISAS, WORKER_ENV, cpu_header, isa_environment, write_models  # noqa: E402

STAGES = {"loaded": re.compile(r"loaded .* in ([\d.]+) s"), "ready": re.compile(r"warm-up finished in ([\d.]+) s")}
FAILED = "warm-up failed"  # the app's log line when the warm-up raised (it serves on, compiling at the first request)
TURBO = "sd-turbo-shape"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppLog:
    """The app's stderr, read on a thread of its own (so that the pipe never fills): when each stage's line came,
    the seconds the app itself reports for it, and the last lines for an error message."""

    def __init__(self, stream, start: float):
        self.start, self.times, self.reported = start, {}, {}
        self.tail: deque[str] = deque(maxlen=40)
        self.ready = threading.Event()  # set at Ready, at a failed warm-up, or when the app ends
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.tail.append(line.rstrip())
            for stage, pattern in STAGES.items():
                if stage not in self.times and (found := pattern.search(line)):
                    self.times[stage] = time.perf_counter() - self.start
                    self.reported[stage] = float(found.group(1))
            if "ready" in self.times or FAILED in line:
                self.ready.set()
        self.ready.set()


def txt2img(port: int, size: int | None, deadline: float) -> dict:
    """One 1-step picture through A1111's door, retried while the server is not listening yet."""
    body = {"prompt": "a photo of a cat", "steps": 1, "seed": 1}
    body |= {"width": size, "height": size} if size else {}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/sdapi/v1/txt2img",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    while True:
        try:
            with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.perf_counter())) as answer:
                reply = json.load(answer)
            break
        except urllib.error.URLError as err:
            if not isinstance(err.reason, ConnectionRefusedError) or time.perf_counter() > deadline:
                raise
            time.sleep(0.2)
    if not reply.get("images") or not base64.b64decode(reply["images"][0]).startswith(b"\x89PNG"):
        raise SystemExit(f"the first request came back without a picture: {str(reply)[:300]}")
    return reply


def cache_entries(folder: Path) -> dict[str, int]:
    """The compiled programs in JAX's cache folder, each with the time it was last written."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*-cache")} if folder.is_dir() else {}


def folder_size(folder: Path) -> dict:
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return {"files": len(files), "mb": round(sum(p.stat().st_size for p in files) / 2**20, 1)}


def start_to_picture(app_args: list[str], size: int | None, root: Path, env: dict, timeout: float) -> dict:
    """One start of app.py with its caches under `root`; seconds from the process's start to each stage."""
    xla, kernels = root / "xla", root / "kernels"
    before = cache_entries(xla)
    kernels_before = set(kernels.glob("*.so")) if kernels.is_dir() else set()
    port = free_port()
    command = [sys.executable, str(ROOT / "app.py"), "--port", str(port), *app_args]
    env = dict(env, JAX_SD_CACHE_DIR=str(xla), JAX_SD_KERNEL_DIR=str(kernels), GRADIO_ANALYTICS_ENABLED="False")
    start = time.perf_counter()
    app = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    log = AppLog(app.stderr, start)
    try:
        log.ready.wait(timeout)
        if "ready" not in log.times:
            tail = "\n".join(log.tail)
            raise SystemExit(f"app.py did not reach Ready (exit {app.poll()}); its last lines:\n{tail}")
        asked = time.perf_counter()
        txt2img(port, size, start + timeout)
        answered = time.perf_counter()
    finally:
        app.terminate()
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
    after = cache_entries(xla)
    built = set(kernels.glob("*.so")) - kernels_before if kernels.is_dir() else set()
    return {
        "start_to_loaded_s": round(log.times["loaded"], 2),
        "start_to_ready_s": round(log.times["ready"], 2),
        "start_to_first_picture_s": round(answered - start, 2),
        "first_picture_s": round(answered - asked, 2),  # the request's own wait, Ready to its answer
        "load_s": log.reported["loaded"],  # as the app logs them: the engine's load (imports excluded), warm-up
        "warmup_s": log.reported["ready"],
        "programs_compiled": sum(1 for name, written in after.items() if before.get(name) != written),
        "kernels_built": bool(built),
        "load_average": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"a diffusers folder, or {TURBO}; default: the embedded model")
    parser.add_argument("--write-sd15", type=Path, help="first write SD 1.5 with random weights to this folder")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "jax-sd-bench-picture",
                        help=f"where {TURBO} is written once (bench/picture.py's own folder)")  # fmt: skip
    parser.add_argument("--quantize", choices=("none", "w8a8"), default="none", help="the app's --quantize")
    parser.add_argument("--size", type=int, help=f"the picture's side (default: 512 for {TURBO}, else the model's)")
    parser.add_argument("--isa", choices=list(ISAS), default="native", help="cap the app's instruction set")
    parser.add_argument("--runs", type=int, default=2, help="starts of each kind, cold and with the caches kept")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a start may take to its first picture")
    args = parser.parse_args()
    model, app_args, size = args.model, [], args.size
    if args.write_sd15:
        from bench import CONFIGS, write_model

        if not (args.write_sd15 / "model_index.json").exists():
            write_model(CONFIGS["sd15"], args.write_sd15, half=False)
        model = str(args.write_sd15)
    if model == TURBO:
        pipe_dir, tiny_dir = write_models("sd-turbo", args.folder)
        app_args += ["--model", str(pipe_dir), "--vae", str(tiny_dir)]
        size = size or 512
    elif model:
        app_args += ["--model", model]
    app_args += ["--quantize", args.quantize] if args.quantize != "none" else []
    env = isa_environment(args.isa, WORKER_ENV)
    report = {"cpu": cpu_header(args.isa).lstrip("# "), "model": model or "embedded", "app_args": app_args}
    report |= {"size": size, "load_average_before": round(os.getloadavg()[0], 2)}
    print(json.dumps(report), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        kept = Path(tmp) / "kept"
        cold = []
        for run in range(args.runs):
            root = kept if run == 0 else Path(tmp) / f"cold-{run}"
            cold.append(start_to_picture(app_args, size, root, env, args.timeout))
            print(json.dumps({"cold": cold[-1]}), flush=True)
            if run == 0:
                report["cache_after_cold"] = folder_size(kept / "xla")
                print(json.dumps({"cache_after_cold": report["cache_after_cold"]}), flush=True)
            else:
                shutil.rmtree(root, ignore_errors=True)
        report["cold"] = cold
        report["kept"] = []
        for _ in range(args.runs):
            report["kept"].append(start_to_picture(app_args, size, kept, env, args.timeout))
            print(json.dumps({"kept": report["kept"][-1]}), flush=True)
    report["load_average_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
