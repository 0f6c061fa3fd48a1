"""Serving many users: continuous batching against the one-at-a-time server, on the same model and machine.

N users each ask for one picture at the same moment (N = 1, 4, 16, 64). Reported per N: images per
second, and the p50 / p95 latency from submit to pictures. "batched" is the engine as the page runs it
(`--max-batch-size` slots); "one-at-a-time" is the same engine with one slot per device, which serves
requests one after the other as the page used to. Each runs in a process of its own.

Two more figures, from the batched engine: N users on N slots against one N-image call (target: within
1.15x), and the latency of a late arrival (submitted while another request is mid-run) against the same
request alone (target: its own run plus at most one chunk).

    python bench/serving.py                      # CPU: the SD-shaped `small` config of bench.py, 256x256
    python bench/serving.py --config sd15        # GPU: SD1.5 at 512x512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import CONFIGS, GUIDANCE, write_model  # noqa: E402 - bench/bench.py, beside this file


def measure(args: argparse.Namespace) -> dict:
    import numpy as np

    from engine import GenerationRequest, load_pipeline
    from engine.serving.programs import lane_widths

    pipe = load_pipeline(args.folder, max_batch_size=args.slots)
    config = CONFIGS[args.config]
    size, guidance = config["size"], GUIDANCE[config.get("family", "sd")]

    def request(seed: int, steps: int = args.steps, images: int = 1) -> GenerationRequest:
        return GenerationRequest(
            "a photo of a cat",
            seed=seed,
            num_inference_steps=steps,
            guidance_scale=guidance,
            height=size,
            width=size,
            num_images=images,
        )

    def crowd(n: int) -> dict:
        start, latencies = time.perf_counter(), []
        tickets = [pipe.submit(request(k)) for k in range(n)]
        for ticket in tickets:
            result = ticket.result()
            latencies.append(result.timings["total_s"])
        wall = time.perf_counter() - start
        return {
            "users": n,
            "images_per_s": n / wall,
            "wall_s": wall,
            "p50_s": float(np.percentile(latencies, 50)),
            "p95_s": float(np.percentile(latencies, 95)),
        }

    # Compile every width first: compiling is not what is measured here (and on a CPU a compile in the
    # background takes cores from the batches that run meanwhile).
    plan = pipe.plan(pipe.limits.resolve(request(0), pipe.defaults))
    pipe.programs.compile(plan, list(lane_widths(plan.slots_per_device)))
    report = {"slots": pipe.batch_size, "runs": [crowd(n) for n in args.users]}
    if args.slots > 1:
        n = pipe.batch_size
        start = time.perf_counter()
        pipe.submit(request(0, images=n)).result()
        one_call = time.perf_counter() - start
        users = crowd(n)["wall_s"]
        report["n_users_vs_one_n_image_call"] = {
            "n": n,
            "users_s": users,
            "one_call_s": one_call,
            "ratio": users / one_call,
        }
        alone = pipe.submit(request(1)).result().timings["total_s"]
        early = pipe.submit(request(2, steps=4 * args.steps))
        seen = threading.Event()
        early.subscribe(lambda e: seen.set() if getattr(e, "step", 0) >= args.steps else None)
        seen.wait()
        late = pipe.submit(request(3)).result().timings["total_s"]
        early.result()
        report["late_arrival"] = {
            "alone_s": alone,
            "late_s": late,
            "extra_s": late - alone,
            "one_step_s": alone / args.steps,
        }
    pipe.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--slots", type=int, default=8, help="the batched engine's --max-batch-size")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args)), flush=True)
        return
    import jax

    report = {"config": args.config, "backend": jax.default_backend(), "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        write_model(CONFIGS[args.config], folder, half=jax.default_backend() != "cpu")
        for name, slots in (("batched", args.slots), ("one-at-a-time", 1)):
            command = [sys.executable, __file__, "--worker", "--folder", str(folder), "--config", args.config]
            command += ["--steps", str(args.steps), "--slots", str(slots), "--users", *map(str, args.users)]
            done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
            if done.returncode:
                raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
            report[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(name, json.dumps(report[name]), flush=True)
    report["speedup_images_per_s"] = {
        run["users"]: run["images_per_s"] / base["images_per_s"]
        for run, base in zip(report["batched"]["runs"], report["one-at-a-time"]["runs"], strict=True)
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
