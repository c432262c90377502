#!/usr/bin/env bash
# One GPU machine call for the HTTP front end, each figure against its baseline in the same run, into OUT:
#   1. the tower alone at 448px x 64 (bench_tower.py: the rate 1 image per request is held to; TOWER=0: not),
#   2. the front end (bench_frontend.py: 4 API processes, distinct 448px JPEGs, 1 image per request from 4
#      client processes x 32 connections, then one image on an idle server), first of each BASE_TREE checkout
#      (earlier commits, separated by spaces, one server each, in that order), then of this tree (VARIANTS;
#      FRONTEND=0: none of it),
#   3. with AB_TREE: bench/ab_frontend.py, that checkout and this one alternated ROUNDS times,
#   4. with MIX: the real-world photo-size mix over HTTP (bench_mix.py) with those servers.
#
#   [TESTS=all|"PATHS"] [TOWER=0] [FRONTEND=0] [GRAPHS="bench_graphs.py flags"] [BASE_TREE="DIR..."]
#   [VARIANTS="name:serve flags;..."] [FE_ARGS="..."] [FE_MORE="..."] [IMAGES=8192] [AB_TREE=DIR ROUNDS=3]
#   [MIX="name:serve flags;..." MIX_REQUESTS=3000 MIX_TIMEOUT=600] bash bench/gpu_frontend.sh OUT
#
#   MIX="defaults:;fp8:--dtype fp8" MIX_REQUESTS=2000 FE_MORE="--idle-requests 300" bash bench/gpu_frontend.sh OUT
#       # bench/RESULTS.md's HTTP lines and the real-world mix (carry .whl and .fa3)
#   TOWER=0 TESTS=tests/unit/store FE_ARGS="--modes 4,4 --stores directory,mooncake --images 4096" bash bench/gpu_frontend.sh OUT
#       # Mooncake against the directory, 1 and 8 images per request, alternated (carry .mc too)
#   TOWER=0 FRONTEND=0 TESTS=all AB_TREE=.baseline bash bench/gpu_frontend.sh OUT
#       # the GPU tests, then the front end of an earlier commit against this one, alternated
#       # (mkdir .baseline && git archive COMMIT | tar -x -C .baseline)
#
# VARIANTS: this tree's servers (bench_frontend --variants; default one, the server's defaults; a variant's
# `@store=DIR` puts its store under DIR). FE_ARGS: bench_frontend.py's load (default "--modes 4 --conc1 32
# --no-x8 --images $IMAGES"), FE_MORE: more of its flags ("--profile-s 5 --no-profile-gil": py-spy of every
# server process). TESTS: GPU tests run first (default none; `all`: bench/gpu_common.sh's GPU_TESTS). GRAPHS:
# first, graph replay against the eager tower per step size (bench_graphs.py). Every tree's modules are
# imported first. Wheels: bench/gpu_common.sh. Prints each step's tail; logs in OUT, the servers' packed into
# OUT/frontend.tgz, OUT/ab_runs.tgz and OUT/mix.tgz.
set -uo pipefail
OUT=${1:?usage: gpu_frontend.sh OUT}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. bench/gpu_common.sh
gpu_setup "$OUT" || exit 1
# shellcheck disable=SC2086  (lists of checkouts)
gpu_imports "$OUT" . ${BASE_TREE:-} ${AB_TREE:-} || exit 1
gpu_tests "$OUT" ""
if [ -n "${GRAPHS:-}" ]; then
  # shellcheck disable=SC2086
  QVE_COMPILE_CACHE=/tmp/fe-cc python3 bench/bench_graphs.py --out "$OUT" $GRAPHS > "$OUT/bench_graphs.log" 2>&1
  tail -12 "$OUT/bench_graphs.log"
fi
if [ "${TOWER:-1}" != 0 ]; then
  python3 bench/bench_tower.py --out "$OUT" --sections ceiling,tower --shapes "448 b64" --no-by-kernel \
    > "$OUT/bench_tower.log" 2>&1
  tail -4 "$OUT/bench_tower.log"
fi
# shellcheck disable=SC2206  (flags as words)
FE=(--no-baseline --compile-cache /tmp/fe-cc ${FE_ARGS:---modes 4 --conc1 32 --no-x8 --images ${IMAGES:-8192}} ${FE_MORE:-})
if [ "${FRONTEND:-1}" != 0 ]; then
  for base in ${BASE_TREE:-}; do  # (several: one server each, in this order, before this tree's)
    name=base-$(basename "$base")
    python3 bench/bench_frontend.py --out "/tmp/frontend/$name" --tree "$base" "${FE[@]}" > "$OUT/frontend_$name.log" 2>&1
    tail -6 "$OUT/frontend_$name.log"
  done
  python3 bench/bench_frontend.py --out /tmp/frontend/tree "${FE[@]}" --variants "${VARIANTS:-:}" \
    > "$OUT/frontend_tree.log" 2>&1
  tail -12 "$OUT/frontend_tree.log"
  tar czf "$OUT/frontend.tgz" -C /tmp frontend 2>/dev/null
fi
if [ -n "${AB_TREE:-}" ]; then
  timeout "${AB_TIMEOUT:-450}" python3 bench/ab_frontend.py --out /tmp/ab --a "$AB_TREE" --b . --rounds "${ROUNDS:-3}" \
    > "$OUT/ab.log" 2>&1
  cp /tmp/ab/ab_frontend.json "$OUT/" 2>/dev/null
  tar czf "$OUT/ab_runs.tgz" -C /tmp ab 2>/dev/null
  tail -6 "$OUT/ab.log"
fi
if [ -n "${MIX:-}" ]; then
  # (its own time limit, so that what it measured is packed even when the call's runs out)
  timeout "${MIX_TIMEOUT:-600}" python3 bench/bench_mix.py --out /tmp/mix --configs "$MIX" --idle 20 \
    --requests "${MIX_REQUESTS:-3000}" > "$OUT/bench_mix.log" 2>&1
  cp /tmp/mix/bench_mix.json "$OUT/" 2>/dev/null
  tar czf "$OUT/mix.tgz" -C /tmp mix 2>/dev/null
  tail -5 "$OUT/bench_mix.log"
fi
