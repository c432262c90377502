#!/usr/bin/env bash
# One GPU machine call (issue 21): HTTP img/s at 1 and 8 images per request with --store mooncake://
# (a mooncake_master on loopback, the server's own segment, TCP) against the /dev/shm directory, alternated
# in one run (bench/bench_frontend.py --stores directory,mooncake), results into OUT.
#
#   [STORE_TESTS=0] [BENCH_ARGS="--profile-s 8 --no-profile-gil"] bash bench/gpu_mooncake.sh OUT [MODES]
#
# The GPU machines have no package registry: wheels come from .whl/ (the service's) and .mc/ (Mooncake's
# cp312 wheel and the Debian packages of the libraries it links, `apt-get download`ed). A Debian library
# goes on LD_LIBRARY_PATH only where the machine lacks it (its own stay in front).
set -uo pipefail
OUT=${1:?usage: gpu_mooncake.sh OUT [MODES]}
MODES=${2:-4,4}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .mc/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH  # (py-spy's binary, where carried)
SO=/tmp/site/mooncake/store.so
libs=""
for pass in 1 2 3; do  # (a library added may need another the machine lacks)
  missing=$(LD_LIBRARY_PATH=$libs ldd $SO /tmp/site/mooncake/mooncake_master | awk '/not found/ {print $1}' | sort -u)
  [ -z "$missing" ] && break
  echo "pass $pass, missing: $missing" >> "$OUT/libs.log"
  for deb in .mc/*.deb; do
    d=/tmp/debs/$(basename "$deb" .deb)
    [ -d "$d" ] || dpkg-deb -x "$deb" "$d"
    for lib in $missing; do
      found=$(find "$d" -name "$lib" | head -1)
      [ -n "$found" ] && case ":$libs:" in *":$(dirname "$found"):"*) ;; *) libs="${libs:+$libs:}$(dirname "$found")";; esac
    done
  done
done
export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >> "$OUT/libs.log"
python3 -c "import mooncake.store, service.store.mooncake" >> "$OUT/libs.log" 2>&1 || { tail -5 "$OUT/libs.log"; exit 1; }
{ date -u; nproc; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
# The store's tests with Mooncake's client working (tests/store/test_mooncake.py runs a real master here too;
# about 50 s: STORE_TESTS=0 leaves them out where a call's 600 s are needed for more).
if [ "${STORE_TESTS:-1}" != 0 ]; then
  PATH=/tmp/site/bin:$PATH timeout 120 python3 -m pytest -q -p no:cacheprovider tests/store \
    > "$OUT/store_tests.log" 2>&1
fi
timeout 480 python3 bench/bench_frontend.py --out "$OUT/frontend" --modes "$MODES" --stores directory,mooncake \
  --no-baseline ${BENCH_ARGS:-} > "$OUT/frontend.log" 2>&1
tail -12 "$OUT/frontend.log"
