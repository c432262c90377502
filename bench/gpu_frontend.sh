#!/usr/bin/env bash
# One GPU machine call for issue 24's HTTP lines, each against its baseline in the same run:
#   1. the tower alone at 448px x 64 (bench_tower.py; the rate 1 image per request is held to),
#   2. the HTTP front end at 1 image per request and one image on an idle server (bench_frontend.py: 4 client
#      processes x 32 connections, distinct 448px JPEGs, per-step phases from /metrics), first of each BASE_TREE
#      (checkouts of earlier commits, separated by spaces, if given), then of this tree,
#   3. the real-world size mix over HTTP (bench_mix.py) with the MIX servers ("name:serve flags;...").
#
#   [BASE_TREE="DIR..."] [VARIANTS="name:serve flags;..."] [MIX="..." MIX_REQUESTS=3000 MIX_TIMEOUT=600] [IMAGES=8192] \
#     [HUGE=DIR] [PROBE=1] [GRAPHS="bench_graphs.py flags"] [FE_MORE="flags"] bash bench/gpu_frontend.sh OUT
#
# VARIANTS: this tree's servers (bench_frontend --variants; default one, the server's defaults).
# HUGE: mount a tmpfs with huge=always at DIR first (a variant's `@store=DIR` puts its store there).
# PROBE: first, what a store write costs on this machine's tmpfs (probe_store_memory.py).
# GRAPHS: first, graph replay against the compiled tower per step size (bench_graphs.py).
# FE_MORE: more bench_frontend.py flags (e.g. "--profile-s 5 --no-profile-gil": py-spy of every server process).
#
# Serving wheels from .whl/ and FlashAttention-3 from .fa3/ (see gpu_tower.sh); logs of 2 and 3 packed into
# OUT/frontend.tgz and OUT/mix.tgz.
set -uo pipefail
OUT=${1:?usage: gpu_frontend.sh OUT}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. bench/gpu_common.sh
gpu_setup "$OUT" .whl .fa3 || exit 1
if [ -n "${HUGE:-}" ]; then
  mkdir -p "$HUGE" && mount -t tmpfs -o huge=always,size=40g tmpfs "$HUGE" && grep " $HUGE " /proc/mounts
fi
if [ -n "${PROBE:-}" ]; then
  python3 bench/probe_store_memory.py --out "$OUT" > "$OUT/probe_store_memory.log" 2>&1
  tail -9 "$OUT/probe_store_memory.log" | cut -c1-400
fi
if [ -n "${GRAPHS:-}" ]; then
  # shellcheck disable=SC2086
  QVE_COMPILE_CACHE=/tmp/fe-cc python3 bench/bench_graphs.py --out "$OUT" $GRAPHS > "$OUT/bench_graphs.log" 2>&1
  tail -12 "$OUT/bench_graphs.log"
fi
python3 bench/bench_tower.py --out "$OUT" --sections ceiling,tower --shapes "448 b64" --no-by-kernel \
  > "$OUT/bench_tower.log" 2>&1
tail -4 "$OUT/bench_tower.log"
FE=(--modes 4 --conc1 32 --no-x8 --no-baseline --images "${IMAGES:-8192}" --compile-cache /tmp/fe-cc ${FE_MORE:-})
for base in ${BASE_TREE:-}; do  # (several: one server each, in this order, before this tree's)
  name=base-$(basename "$base")
  python3 bench/bench_frontend.py --out "/tmp/frontend/$name" --tree "$base" "${FE[@]}" > "$OUT/frontend_$name.log" 2>&1
  tail -6 "$OUT/frontend_$name.log"
done
python3 bench/bench_frontend.py --out /tmp/frontend/tree "${FE[@]}" --variants "${VARIANTS:-:}" > "$OUT/frontend_tree.log" 2>&1
tail -8 "$OUT/frontend_tree.log"
tar czf "$OUT/frontend.tgz" -C /tmp frontend 2>/dev/null
if [ -n "${MIX:-}" ]; then
  # (its own time limit, so that what it measured is packed even when the call's runs out)
  timeout "${MIX_TIMEOUT:-600}" python3 bench/bench_mix.py --out /tmp/mix --configs "$MIX" --idle 20 \
    --requests "${MIX_REQUESTS:-3000}" > "$OUT/bench_mix.log" 2>&1
  cp /tmp/mix/bench_mix.json "$OUT/" 2>/dev/null
  tar czf "$OUT/mix.tgz" -C /tmp mix 2>/dev/null
  tail -5 "$OUT/bench_mix.log"
fi
