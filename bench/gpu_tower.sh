#!/usr/bin/env bash
# One GPU machine call for the tower (issue 24): the GPU tests of every attention kernel and FP8, then
# bench/bench_tower.py (transformers, our bf16 tower with the measured attention plan, each kernel forced,
# and --dtype fp8 with its accuracy on real photographs), results into OUT.
#
#   bash bench/gpu_tower.sh OUT [SECTIONS] [EXTRA bench_tower ARGS...]
#
# MIX="name:serve flags;..." then runs bench/bench_mix.py (the real-world size mix over HTTP) with those
# servers (MIX_ARGS: more of its arguments), its logs packed into OUT/mix.tgz; FRONTEND="ARGS" then runs
# bench/bench_frontend.py ARGS (the step loop against pre-built requests), its logs packed into OUT/frontend.tgz.
# BASE_TREE=DIR first runs bench_tower.py of that checkout (an earlier commit: `git archive COMMIT | tar -x -C DIR`)
# with the same arguments but BASE_SECTIONS (default ceiling,tower), into OUT/base: a baseline in the same run.
# FlashAttention-3 (the `fa3` extra) is installed from .fa3/ when that folder holds its wheel, serving
# wheels from .whl/ (the GPU machines have no package registry); TESTS=0 skips the tests. The wheel, on a
# machine with the registry: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_24_x86_64 -d .fa3 fa3-fwd==0.0.3` (27.6 MB; ignored by git through .git/info/exclude).
set -uo pipefail
OUT=${1:?usage: gpu_tower.sh OUT [SECTIONS] [ARGS...]}
SECTIONS=${2:-ceiling,tower,accuracy,fp8}
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. bench/gpu_common.sh
gpu_setup "$OUT" .whl .fa3 .fa4 || exit 1
cat "$OUT/machine.txt"
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_attention_cuda.py tests/engine/test_tower_cuda.py \
    tests/engine/test_attention.py tests/engine/test_tower.py ${MORE_TESTS:-} > "$OUT/gpu_tests.log" 2>&1
  tail -25 "$OUT/gpu_tests.log"
fi
if [ -n "${BASE_TREE:-}" ]; then
  (cd "$BASE_TREE" && python3 bench/bench_tower.py --out "$OUT/base" --sections "${BASE_SECTIONS:-ceiling,tower}" "$@") \
    > "$OUT/bench_tower_base.log" 2>&1
  tail -8 "$OUT/bench_tower_base.log"
fi
python3 bench/bench_tower.py --out "$OUT" --sections "$SECTIONS" "$@" > "$OUT/bench_tower.log" 2>&1
tail -40 "$OUT/bench_tower.log"
if [ -n "${MIX:-}" ]; then
  python3 bench/bench_mix.py --out /tmp/mix --configs "$MIX" ${MIX_ARGS:-} > "$OUT/bench_mix.log" 2>&1
  cp /tmp/mix/bench_mix.json "$OUT/" 2>/dev/null
  tar czf "$OUT/mix.tgz" -C /tmp mix 2>/dev/null
  tail -8 "$OUT/bench_mix.log"
fi
if [ -n "${FRONTEND:-}" ]; then
  python3 bench/bench_frontend.py --out /tmp/frontend $FRONTEND > "$OUT/bench_frontend.log" 2>&1
  tar czf "$OUT/frontend.tgz" -C /tmp frontend 2>/dev/null
  tail -12 "$OUT/bench_frontend.log"
fi
