#!/usr/bin/env bash
# One GPU machine call (issue 22): the GPU tests of the engine (the video staging of test_core_cuda.py among
# them), then bench/bench_video.py (video throughput against transformers), results into OUT.
#
#   bash bench/gpu_video.sh OUT [BENCH_VIDEO_ARGS...]
#
# The GPU machines have no package registry: wheels come from .whl/ (the service's) and .wav/ (PyAV's).
set -uo pipefail
OUT=${1:?usage: gpu_video.sh OUT [BENCH_VIDEO_ARGS...]}
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .wav/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
{ date -u; nproc; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv;
  python3 -c "import torch, transformers, torchvision, av; print('torch', torch.__version__, 'transformers', transformers.__version__, 'torchvision', torchvision.__version__, 'av', av.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_core_cuda.py tests/engine/test_tower_cuda.py \
  tests/engine/test_runner.py tests/engine/test_pool.py tests/kernels > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
timeout 420 python3 bench/bench_video.py --out "$OUT" "$@" > "$OUT/bench_video.log" 2>&1
tail -14 "$OUT/bench_video.log"
