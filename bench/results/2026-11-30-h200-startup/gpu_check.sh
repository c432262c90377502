#!/bin/bash
# GPU check of issue 11's start-up path: preflight's CUDA probe, fail-fast timing, /ready phases on cuda.
set -um  # -m: background jobs keep SIGINT (a non-interactive shell would ignore it for them)
git log -1 --oneline 2>/dev/null; ls service/preflight.py service/boot.py || exit 1
nvidia-smi -L
python3 - <<'PY'
import time
t0 = time.perf_counter()
from service.preflight import cuda_device_count, check_device
n = cuda_device_count(); print("cuda_device_count", n, "in", round(time.perf_counter() - t0, 3), "s")
check_device("cuda:0"); check_device("cuda")
try:
    check_device(f"cuda:{n}")
except Exception as e:
    print("cuda:N beyond:", e)
PY
/usr/bin/time -f "fail-fast wall %e s" python3 -m service serve --device cuda:7 --port 0; echo "rc=$?"
python3 -m service serve --model qwen3-vl-4b --device cuda --store /tmp/st --port 18080 > $OUT/serve.log 2>&1 &
PID=$!
python3 - <<'PY' > $OUT/phases.txt 2>&1
import time, httpx
t0 = time.monotonic(); last = None
while time.monotonic() - t0 < 300:
    try:
        r = httpx.get("http://127.0.0.1:18080/ready", timeout=5)
        j = r.json(); key = (r.status_code, j.get("phase"))
        if key != last:
            print(f"{time.monotonic() - t0:7.2f} s  {r.status_code} {j.get('phase')}", flush=True); last = key
        if r.status_code == 200:
            print(j); break
    except Exception as e:
        key = type(e).__name__
        if key != last:
            print(f"{time.monotonic() - t0:7.2f} s  {key}", flush=True); last = key
    time.sleep(0.05)
PY
cat $OUT/phases.txt
python3 -m service try --url http://127.0.0.1:18080
python3 -m service try --url http://127.0.0.1:18080 | grep cached
kill -INT $PID; wait $PID; echo "serve exit=$?"
grep -c Traceback $OUT/serve.log; tail -25 $OUT/serve.log
