#!/usr/bin/env bash
# One GPU machine call for video: the engine's GPU tests (the video step of test_core_cuda.py among them), then
# bench/bench_video.py (video throughput against transformers' video processor + tower), into OUT.
#
#   [TESTS=all|0|"PATHS"] bash bench/gpu_video.sh OUT [bench_video.py ARGS...]
#
#   bash bench/gpu_video.sh OUT        # bench/RESULTS.md's video figures (carry .whl and .wav: PyAV)
#
# The wheels the machine needs: bench/gpu_common.sh. Prints the tests' and the benchmark's tails; everything
# is in OUT (machine.txt, gpu_tests.log, bench_video.json and .log).
set -uo pipefail
OUT=${1:?usage: gpu_video.sh OUT [BENCH_VIDEO_ARGS...]}
shift
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. bench/gpu_common.sh
gpu_setup "$OUT" || exit 1
TESTS_TIMEOUT=${TESTS_TIMEOUT:-240} gpu_tests "$OUT" "tests/unit/engine/test_core_cuda.py tests/unit/engine/test_tower_cuda.py
  tests/unit/engine/test_runner.py tests/unit/engine/test_pool.py tests/unit/kernels"
timeout 420 python3 bench/bench_video.py --out "$OUT" "$@" > "$OUT/bench_video.log" 2>&1
tail -14 "$OUT/bench_video.log"
