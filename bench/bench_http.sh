#!/usr/bin/env bash
# HTTP front-end throughput on a GPU box: where does an image spend its time between the client and
# the step loop? Starts the real server (default: qwen3-vl-4b preset, bf16), then runs `python3 -m service loadtest`
# in several shapes, optionally under py-spy (if installed) to see which thread is busy.
#   bash bench/bench_http.sh OUTDIR [MODEL]
set -euo pipefail
OUT=${1:?usage: bench_http.sh OUTDIR [MODEL]}; MODEL=${2:-qwen3-vl-4b}; PORT=18090
mkdir -p "$OUT"; STORE=$(mktemp -d /dev/shm/qve-bench.XXXX)
python3 -m service serve --model "$MODEL" --device cuda --store "$STORE" --port $PORT --decode-workers 8 \
  --max-wait-ms 3 --store-capacity-bytes 30000000000 > "$OUT/http_server.log" 2>&1 &
SRV=$!; trap 'kill $SRV 2>/dev/null; wait $SRV 2>/dev/null; rm -rf "$STORE"' EXIT
for _ in $(seq 300); do curl -sf localhost:$PORT/ready >/dev/null 2>&1 && break; sleep 1; done
lt() { python3 -m service loadtest --url http://127.0.0.1:$PORT --sizes 448x448 --unique --gen-workers 4 "$@"; }
echo "== 1 image/request, 64 clients"; lt --concurrency 64 --requests 768 --out "$OUT/lt_1x64.json" | tail -n 4
curl -s localhost:$PORT/metrics | grep -E "^qve_(step_images_(sum|count)|step_seconds_(sum|count))"
echo "== 8 images/request, 16 clients"; lt --concurrency 16 --images-per-request 8 --requests 128 --out "$OUT/lt_8x16.json" | tail -n 4
echo "== three client processes, 1 image/request, 32 clients each"
PIDS=(); for c in a b c; do lt --concurrency 32 --requests 512 --out "$OUT/lt_3$c.json" > "$OUT/lt_3$c.txt" & PIDS+=($!); done
wait "${PIDS[@]}"
tail -n 4 "$OUT"/lt_3?.txt
if [ -n "${PROFILE:-}" ] && command -v py-spy >/dev/null; then
  echo "== profile (py-spy --gil: who holds the GIL, 12 s) under 1 image/request, 64 clients"
  py-spy record -p $SRV -d 12 -r 100 --gil -f raw -o "$OUT/pyspy_gil.txt" --nonblocking > "$OUT/pyspy.log" 2>&1 & P=$!
  lt --concurrency 64 --requests 1500 --duration-s 12 --out "$OUT/lt_prof.json" | tail -n 4; wait $P || true
  python3 bench/pyspy_top.py "$OUT/pyspy_gil.txt" > "$OUT/pyspy_gil_top.txt" || true
fi
curl -s localhost:$PORT/metrics | grep -E "^qve_(steps_total|step_images_(sum|count)|step_seconds_(sum|count)|fence_waits|images_total)" | tee "$OUT/http_metrics.txt"
