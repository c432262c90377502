#!/usr/bin/env bash
# One GPU machine call for FlashAttention-4 against the other attention kernels (issue 24): the kernel probe
# (bench/probe_fa4.py), the attention and tower GPU tests with FA4 installed, then bench/bench_tower.py's
# ceiling, tower (transformers, the measured plan, each kernel forced), graphs and accuracy sections.
#
#   bash bench/gpu_fa4.sh OUT [SHAPES]
#
# Needs .whl/ (the serving wheels; the tests' helpers import uvicorn and fastapi), .fa3/, .fa4/ and FA4's
# CuTe DSL module unpacked by an earlier call on the same machine into /tmp/fa4lib (bench/gpu_common.sh says
# why): first `. bench/gpu_common.sh && gpu_setup /tmp/o` with .fa4a carried, then this with .whl .fa3 .fa4.
set -uo pipefail
OUT=${1:?usage: gpu_fa4.sh OUT [SHAPES]}
SHAPES=${2:-448 b64,1024 b16,real-world 10}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. bench/gpu_common.sh
gpu_setup "$OUT" .whl .fa3 .fa4 || exit 1
cat "$OUT/machine.txt"
timeout 170 python3 bench/probe_fa4.py --out "$OUT" > "$OUT/probe_fa4.log" 2>&1
grep -v 'Warning\|exe_args' "$OUT/probe_fa4.log" | cut -c1-300 | tail -30
[ "${TESTS:-1}" = 0 ] || timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_attention_cuda.py tests/engine/test_tower_cuda.py \
  > "$OUT/gpu_tests.log" 2>&1
[ "${TESTS:-1}" = 0 ] || tail -4 "$OUT/gpu_tests.log"
timeout 300 python3 bench/bench_tower.py --out "$OUT" --sections ceiling,tower,graphs,accuracy --shapes "$SHAPES" \
  > "$OUT/bench_tower.log" 2>&1
grep -v 'Warning\|exe_args' "$OUT/bench_tower.log" | cut -c1-1200 | tail -30
