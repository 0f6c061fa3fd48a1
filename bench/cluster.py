"""The cluster path against one machine: images per second with 1 and 2 engine replicas, and what the hops cost.

N users (`gradio_client`, one picture each) press Generate at the same moment; reported per system: images
per second over the whole crowd, and the latency of one user alone (the median of a few requests, from
submit to pictures). The systems, one after the other on the same model and machine:

- `engine`: the engine in a process of its own, pinned to one core, no web server (the floor);
- `app.py`: `python app.py`, pinned to one core: the single-machine page;
- `cluster-1`, `cluster-2`: a local Ray cluster (`cluster/`): the page as the ingress, and 1 or 2 engine
  replicas, each pinned to a core of its own; Ray's own processes and the page run where the OS puts them.

The overhead of the cluster path is `cluster-1` against `app.py`: the same engine on one core, plus Serve's
proxy, the page's deployment handle and the events streamed back from the replica. Each system first draws
one unmeasured crowd, so that every batch width is compiled (or loaded from the shared disk cache).

    python bench/cluster.py                          # the SD-shaped `small` config of bench.py, 256x256
    python bench/cluster.py --config embedded        # the embedded model, 64x64: the hops matter more
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))
# A cluster on this machine alone: Ray's processes talk over the loopback address (read when Ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# On a machine busy with other work, Serve's HTTP proxy can take longer than the 5 s Serve allows it to report ready.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")

from bench import CONFIGS, GUIDANCE, write_model  # noqa: E402 - bench/bench.py, beside this file

PROMPT = "a yellow star on a purple background"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(pid: int, core: int) -> None:
    """Every thread of a process (JAX's pools are made at start-up) onto one core."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), {core})
        except ProcessLookupError:
            pass


def wait_for(url: str, process: subprocess.Popen | None = None, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


# ---- the users ----------------------------------------------------------------------------------


class Users:
    """N `gradio_client` users of one page."""

    def __init__(self, url: str, n: int, size: int, steps: int, guidance: float, downloads: Path):
        from gradio_client import Client

        self.args = dict(size=f"{size}x{size}", steps=steps, guidance_scale=guidance, random_seed=False)
        with cf.ThreadPoolExecutor(8) as pool:
            make = lambda k: Client(url, verbose=False, download_files=str(downloads / f"user{k}"))  # noqa: E731
            self.clients = list(pool.map(make, range(n)))

    def ask(self, k: int, seed: int) -> tuple[float, str]:
        start = time.perf_counter()
        gallery, _, _ = self.clients[k].predict(prompt=PROMPT, seed=seed, api_name="/generate", **self.args)
        items = gallery["value"] if isinstance(gallery, dict) else gallery
        return time.perf_counter() - start, items[0]["caption"]

    def crowd(self, seed: int) -> dict:
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(len(self.clients)) as pool:
            answers = list(pool.map(self.ask, range(len(self.clients)), range(seed, seed + len(self.clients))))
        wall = time.perf_counter() - start
        replicas = sorted({caption.split(" · ")[0] for _, caption in answers if caption.startswith("replica")})
        return {"images_per_s": len(answers) / wall, "wall_s": wall, "replicas_seen": replicas}

    def alone(self, seed: int, reps: int) -> float:
        return statistics.median(self.ask(0, seed + k)[0] for k in range(reps))


def measure(users: Users, rounds: int, reps: int) -> dict:
    users.crowd(seed=10_000)  # compiles (or loads) every batch width: not measured
    crowds = [users.crowd(seed=1000 * (r + 1)) for r in range(rounds)]
    best = max(crowds, key=lambda c: c["images_per_s"])
    return {**best, "alone_s": users.alone(seed=50_000, reps=reps)}


# ---- the systems -----------------------------------------------------------------------------------


def engine_worker(args: argparse.Namespace) -> None:
    """`engine`: runs pinned by taskset in a process of its own; prints one JSON line."""
    import engine

    pipe = engine.load_pipeline(args.folder, max_batch_size=args.max_batch_size, sizes=[(args.size, args.size)])
    request = lambda seed: engine.GenerationRequest(  # noqa: E731
        PROMPT, seed=seed, num_inference_steps=args.steps, guidance_scale=args.guidance, num_images=1
    )

    def crowd(seed: int) -> float:
        start = time.perf_counter()
        for ticket in [pipe.submit(request(seed + k)) for k in range(args.users)]:
            ticket.result()
        return args.users / (time.perf_counter() - start)

    crowd(10_000)
    best = max(crowd(1000 * (r + 1)) for r in range(args.rounds))
    alone = []
    for k in range(args.reps):
        start = time.perf_counter()
        pipe.submit(request(50_000 + k)).result()
        alone.append(time.perf_counter() - start)
    pipe.close()
    print(json.dumps({"images_per_s": best, "alone_s": statistics.median(alone)}), flush=True)


def bench_engine(args: argparse.Namespace, env: dict) -> dict:
    command = ["taskset", "-c", "0", sys.executable, __file__, "--engine-worker", "--folder", str(args.folder)]
    command += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("max_batch_size", "size", "steps", "users")]
    command += [f"--guidance={args.guidance}", f"--rounds={args.rounds}", f"--reps={args.reps}"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"engine failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_app(args: argparse.Namespace, env: dict, work: Path) -> dict:
    port = free_port()
    command = ["taskset", "-c", "0", sys.executable, str(ROOT / "app.py"), "--model", str(args.folder)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-batch-size", str(args.max_batch_size)]
    command += ["--sizes", f"{args.size}x{args.size}", "--queue-size", str(4 * args.users)]
    with open(work / "app.log", "w") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_for(url, server)
            return measure(Users(url, args.users, args.size, args.steps, args.guidance, work), args.rounds, args.reps)
        finally:
            server.terminate()
            server.wait(timeout=60)


def replica_pids() -> list[int]:
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "ServeReplica:jax-sd:EngineReplica" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(found)


def bench_cluster(args: argparse.Namespace, env: dict, work: Path) -> dict:
    import ray
    from ray import serve
    from ray.serve.schema import LoggingConfig

    import cluster

    env = {**env, "PYTHONPATH": str(ROOT)}
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, runtime_env={"env_vars": env})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/"
    settings = cluster.ClusterSettings(
        model=str(args.folder),
        max_batch_size=args.max_batch_size,
        sizes=((args.size, args.size),),
        concurrency=4 * args.users,
        queue_size=4 * args.users,
    )
    quiet = LoggingConfig(log_level="WARNING", enable_access_log=False)
    report = {}
    try:
        for replicas in (1, 2):
            started = time.perf_counter()
            replica = cluster.EngineReplica.options(num_replicas=replicas, max_ongoing_requests=4 * args.users)
            serve.run(cluster.application(settings, replica=replica), name="jax-sd", logging_config=quiet)
            pids = replica_pids()
            while len(pids) != replicas:  # a replaced replica may still be on its way out
                time.sleep(0.2)
                pids = replica_pids()
            for core, pid in enumerate(pids):
                pin(pid, core)
            wait_for(url)
            up_s = time.perf_counter() - started
            users = Users(url, args.users, args.size, args.steps, args.guidance, work / f"cluster{replicas}")
            report[f"cluster-{replicas}"] = {**measure(users, args.rounds, args.reps), "deploy_s": up_s}
            print(f"cluster-{replicas}", json.dumps(report[f"cluster-{replicas}"]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", choices=["embedded", *sorted(c for c in CONFIGS if "sdxl" not in c)], default="small"
    )
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-batch-size", type=int, default=8, help="pictures one engine draws at once")
    parser.add_argument("--rounds", type=int, default=2, help="measured crowds per system; the best is reported")
    parser.add_argument("--reps", type=int, default=5, help="requests of one user alone; the median is reported")
    parser.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--guidance", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_worker:
        engine_worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_SD_CACHE_DIR": str(work / "xla"),  # shared: each system after the first loads its programs
            "GRADIO_TEMP_DIR": str(work / "gradio"),
            "GRADIO_ANALYTICS_ENABLED": "False",
            "HF_HUB_OFFLINE": "1",
        }
        if args.config == "embedded":
            args.folder, args.size, args.guidance = str(ROOT / "engine" / "assets" / "default"), 64, 5.0
        else:
            args.folder = work / "model"
            write_model(CONFIGS[args.config], args.folder, half=False)
            args.size, args.guidance = CONFIGS[args.config]["size"], GUIDANCE["sd"]
        report = {
            "config": args.config,
            "size": args.size,
            "users": args.users,
            "steps": args.steps,
            "max_batch_size": args.max_batch_size,
            "load_average_at_start": os.getloadavg()[0],
        }
        report["engine"] = bench_engine(args, env)
        print("engine", json.dumps(report["engine"]), flush=True)
        report["app.py"] = bench_app(args, env, work)
        print("app.py", json.dumps(report["app.py"]), flush=True)
        report.update(bench_cluster(args, env, work))
        one, app = report["cluster-1"], report["app.py"]
        report["cluster_overhead"] = {
            "images_per_s_app_over_cluster_1": app["images_per_s"] / one["images_per_s"],
            "alone_extra_s": one["alone_s"] - app["alone_s"],
            "scaling_2_over_1": report["cluster-2"]["images_per_s"] / one["images_per_s"],
        }
        report["load_average_at_end"] = os.getloadavg()[0]
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
