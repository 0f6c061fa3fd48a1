#!/usr/bin/env bash
# The GPU measurements: the GPU tests, then SD1.5 and SDXL against diffusers.
#
#   bash bench/gpu.sh [tests|sd15|chunks|sdxl|all] [RESULTS_DIR]
#
# Each part takes a few minutes (SD1.5 also times diffusers with torch.compile); run them as
# separate commands where one command's time is limited. On a machine with no network, put
# wheels of what it lacks (diffusers, for one) in .whl/; they are installed into /tmp/site
# first. Reports go to RESULTS_DIR (default: bench-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
results=${2:-bench-results}
mkdir -p "$results"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$results/gpu.txt"
python3 -c "import jax, flax, diffusers, torch; print(jax.__version__, flax.__version__, diffusers.__version__, torch.__version__)" \
  | tee -a "$results/gpu.txt"
if [[ $part == tests || $part == all ]]; then
  python3 -m pytest -q tests/test_gpu.py 2>&1 | tee "$results/test_gpu.txt"
fi
if [[ $part == sd15 || $part == all ]]; then
  python3 bench/bench.py --config sd15 --images 1 8 --compile | tee "$results/sd15.json"
fi
if [[ $part == chunks || $part == all ]]; then  # ours alone, four steps a dispatch: the host's share of a step
  python3 bench/bench.py --config sd15 --images 1 8 --skip-reference --chunk-steps 4 | tee "$results/sd15_chunks4.json"
fi
if [[ $part == sdxl || $part == all ]]; then
  python3 bench/bench.py --config sdxl --images 1 4 | tee "$results/sdxl.json"
fi
