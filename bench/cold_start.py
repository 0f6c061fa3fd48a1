"""Cold start: from `python app.py` to Ready, with an empty and with a filled compile cache.

Starts the app as a user would, on a free local port, reads its log until the warm-up has finished
(the moment the page says "Ready"), stops it, and prints the times of each stage as JSON: the
process's start to the model loaded, and to Ready. Run each case several times; the first
empty-cache run also fills the cache that the filled-cache runs read.

    python bench/cold_start.py                              # the embedded model
    python bench/cold_start.py --write-sd15 /tmp/sd15        # write SD 1.5 (random weights) once, then time it
    python bench/cold_start.py --model /tmp/sd15 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"loaded": re.compile(r"loaded .* in ([\d.]+) s"), "ready": re.compile(r"warm-up finished in ([\d.]+) s")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_ready(model: str | None, cache: Path, timeout: float) -> dict:
    """One start of app.py; seconds from the process's start to each stage."""
    command = [sys.executable, str(ROOT / "app.py"), "--port", str(free_port())]
    command += ["--model", model] if model else []
    env = dict(os.environ, JAX_SD_CACHE_DIR=str(cache), GRADIO_ANALYTICS_ENABLED="False")
    start = time.perf_counter()
    app = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    times, reported = {}, {}
    try:
        for line in app.stderr:
            for stage, pattern in STAGES.items():
                if stage not in times and (found := pattern.search(line)):
                    times[stage] = time.perf_counter() - start
                    reported[stage] = float(found.group(1))
            if "ready" in times or time.perf_counter() - start > timeout:
                break
    finally:
        app.terminate()
        app.wait(30)
    if "ready" not in times:
        raise SystemExit(f"app.py did not reach Ready (exit {app.returncode})")
    return {
        "start_to_loaded_s": times["loaded"],
        "load_s": reported["loaded"],  # as the app logs it: the engine's load, imports excluded
        "warmup_s": reported["ready"],
        "start_to_ready_s": times["ready"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a diffusers folder; default: the embedded model")
    parser.add_argument("--write-sd15", type=Path, help="first write SD 1.5 with random weights to this folder")
    parser.add_argument("--runs", type=int, default=2, help="starts with the filled cache")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    model = args.model
    if args.write_sd15:
        sys.path.insert(0, str(ROOT / "bench"))
        from bench import CONFIGS, write_model

        if not (args.write_sd15 / "model_index.json").exists():
            write_model(CONFIGS["sd15"], args.write_sd15, half=False)
        model = str(args.write_sd15)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        report = {"model": model or "embedded", "load_average": os.getloadavg()[0]}
        report["empty_cache"] = start_to_ready(model, cache, args.timeout)
        print(json.dumps(report["empty_cache"]), flush=True)
        report["filled_cache"] = [start_to_ready(model, cache, args.timeout) for _ in range(args.runs)]
        report["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
