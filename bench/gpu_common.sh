# Sourced by the GPU machine scripts from the checkout's root. `gpu_setup OUT DIR...`: makes OUT, installs the
# wheels of each DIR that holds any into /tmp/site and puts it (and its bin/: py-spy) on the paths (the machines
# have no package registry; .whl: the serving wheels and py-spy, .fa3: FlashAttention-3, ...), and writes
# OUT/machine.txt (date, tree, CPUs, GPU, torch, transformers, FA3). Returns non-zero if pip fails.
gpu_setup() {
  local out=$1 d
  shift
  mkdir -p "$out"
  for d in "$@"; do
    if ls "$d"/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
        || return 1
      export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
    fi
  done
  export PYTHONUNBUFFERED=1
  { date -u; git log -1 --format='tree %h %s' 2>/dev/null; nproc;
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv;
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)
from service.engine import attention; print('FA3', attention.fa3_status())"; } > "$out/machine.txt" 2>&1
  return 0  # (machine.txt says what was missing)
}
