#!/usr/bin/env bash
# One GPU machine call: the GPU tests on this tree, then the front end of a baseline tree against this one
# (bench/ab_frontend.py), results into OUT.
#
#   bash bench/gpu_check.sh OUT [BASELINE_TREE] [ROUNDS]
#
# BASELINE_TREE: a checkout of the earlier commit (e.g. `git archive <commit> service kernels pyproject.toml
# | tar -x -C .baseline`); without it only the tests run. Wheels missing on the machine are installed from
# .whl/ first when that folder exists (the GPU machines have no package registry).
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT [BASELINE_TREE] [ROUNDS]}
BASE=${2:-}
ROUNDS=${3:-3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1
# Every module of both trees imports here (a missing wheel fails in seconds, not after the servers' retries),
# but vLLM's connector: vLLM is not on the GPU machines, and nothing measured here runs it.
for tree in . $BASE; do
  (cd "$tree" && python3 -c "import importlib, pkgutil, service
for m in pkgutil.walk_packages(service.__path__, 'service.'):
    if m.name != 'service.lm.vllm_connector': importlib.import_module(m.name)") \
    > "$OUT/imports.log" 2>&1 || { echo "imports fail in $tree:"; tail -5 "$OUT/imports.log"; exit 1; }
done
{ date -u; nproc; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
# The tests that use the GPU where there is one (they skip without), and the image corpus's bit-identity.
python3 -m pytest -q -p no:cacheprovider tests/engine/test_core_cuda.py tests/engine/test_tower_cuda.py \
  tests/engine/test_attention_cuda.py \
  tests/engine/test_pool.py tests/engine/test_runner.py tests/engine/test_tower.py tests/kernels tests/media/test_images.py \
  tests/store > "$OUT/gpu_tests.log" 2>&1
if [ -n "$BASE" ]; then
  timeout 450 python3 bench/ab_frontend.py --out /tmp/ab --a "$BASE" --b . --rounds "$ROUNDS" > "$OUT/ab.log" 2>&1
  cp /tmp/ab/ab_frontend.json "$OUT/" 2>/dev/null
  tar czf "$OUT/ab_runs.tgz" -C /tmp ab 2>/dev/null
fi
