#!/usr/bin/env bash
# One GPU machine call for the tower: the GPU tests, then bench/bench_tower.py (transformers, our bf16 tower with
# the measured attention plan, each kernel forced, --dtype fp8 and its accuracy on real photographs), into OUT.
#
#   [TESTS=all|0|"PATHS"] [MORE_TESTS="PATHS"] [BASE_TREE=DIR [BASE_SECTIONS=ceiling,tower]] \
#     bash bench/gpu_tower.sh OUT [SECTIONS] [bench_tower.py ARGS...]
#
#   bash bench/gpu_tower.sh OUT ceiling,tower,graphs,accuracy,fp8 --shapes "448 b64,1024 b16,real-world 10"
#       # the tower figures of bench/RESULTS.md (carry .whl and .fa3; .fa4 for FlashAttention-4 too)
#
# SECTIONS: bench_tower.py's (default ceiling,tower,accuracy,fp8). TESTS: the tests run first (default `all`:
# bench/gpu_common.sh's GPU_TESTS; the video step among them needs .wav), MORE_TESTS added to them. BASE_TREE=DIR
# first runs bench_tower.py of that checkout (an earlier commit: `mkdir DIR && git archive COMMIT | tar -x -C DIR`)
# with the same ARGS but BASE_SECTIONS, into OUT/base: a baseline in the same run. The wheels the machine needs
# (it has no package registry): bench/gpu_common.sh. Prints the tests' and the benchmark's tails; everything
# is in OUT (machine.txt, gpu_tests.log, bench_tower.json and .log).
set -uo pipefail
OUT=${1:?usage: gpu_tower.sh OUT [SECTIONS] [ARGS...]}
SECTIONS=${2:-ceiling,tower,accuracy,fp8}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. bench/gpu_common.sh
gpu_setup "$OUT" || exit 1
cat "$OUT/machine.txt"
gpu_tests "$OUT" all
if [ -n "${BASE_TREE:-}" ]; then
  (cd "$BASE_TREE" && python3 bench/bench_tower.py --out "$OUT/base" --sections "${BASE_SECTIONS:-ceiling,tower}" "$@") \
    > "$OUT/bench_tower_base.log" 2>&1
  tail -8 "$OUT/bench_tower_base.log"
fi
python3 bench/bench_tower.py --out "$OUT" --sections "$SECTIONS" "$@" > "$OUT/bench_tower.log" 2>&1
tail -40 "$OUT/bench_tower.log"
