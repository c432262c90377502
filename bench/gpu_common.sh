# Sourced by the GPU machine scripts from the checkout's root. `gpu_setup OUT DIR...`: makes OUT, installs the
# wheels of each DIR that holds any into /tmp/site and puts it (and its bin/: py-spy) on the paths (the machines
# have no package registry; .whl: the serving wheels and py-spy, .fa3: FlashAttention-3, .fa4: FlashAttention-4,
# ...), and writes OUT/machine.txt (date, tree, CPUs, GPU, torch, transformers, FA3, FA4). Returns non-zero if
# pip fails. FA4's CUDA 13 library wheel (92 MB) is over what one call carries: .fa4 holds it without its two
# large files, one of them xz-packed beside it (libcute_dsl_runtime.so.xz), and the other (the CuTe DSL's
# pybind module, 50 MB packed) comes in an earlier call to the same warm machine as .fa4a/cutlass_ir.so.xz,
# which this unpacks into /tmp/fa4lib (kept between calls; the checkout's untracked folders are not).
_unxz() { python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2"; }

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
  if [ -f .fa4a/cutlass_ir.so.xz ]; then
    mkdir -p /tmp/fa4lib && _unxz .fa4a/cutlass_ir.so.xz /tmp/fa4lib/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so || return 1
  fi
  if [ -f .fa4/libcute_dsl_runtime.so.xz ] && [ -d /tmp/site/nvidia_cutlass_dsl ]; then
    _unxz .fa4/libcute_dsl_runtime.so.xz /tmp/site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so || return 1
    cp /tmp/fa4lib/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so /tmp/site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/ \
      || echo "FA4: /tmp/fa4lib holds no CuTe DSL module: send .fa4a/ first (gpu_setup with it carried)" >&2
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages  # its .pth is not read under --target
  fi
  export PYTHONUNBUFFERED=1
  { date -u; git log -1 --format='tree %h %s' 2>/dev/null; nproc;
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv;
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)
from service.engine import attention; print('FA3', attention.fa3_status()); print('FA4', attention.fa4_status())"; } > "$out/machine.txt" 2>&1
  return 0  # (machine.txt says what was missing)
}
