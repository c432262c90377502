# Sourced by the GPU machine scripts (bench/gpu_tower.sh, gpu_frontend.sh, gpu_video.sh) from the checkout's root.
#
# The GPU machines have no package registry: what a run needs comes as wheels in folders carried with the tree
# (ignored by git through .git/info/exclude), each installed where it holds any:
#   .whl  the serving dependencies (and py-spy)      .fa3  FlashAttention-3 (the `fa3` extra: fa3-fwd)
#   .fa4  FlashAttention-4 (the `fa4` extra; below)  .wav  PyAV (the `video` extra: the video tests and benchmark)
#   .mc   Mooncake's cp312 wheel and the Debian packages of the libraries it links (`apt-get download`)
# FlashAttention-3's wheel, on a machine with the registry: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_24_x86_64 -d .fa3 fa3-fwd==0.0.3` (27.6 MB).
#
# gpu_setup OUT      makes OUT, installs those wheels into /tmp/site and puts it (and its bin/: py-spy,
#                    mooncake_master) on the paths, puts a Debian library of .mc on LD_LIBRARY_PATH where the
#                    machine lacks it (its own stay in front), and writes OUT/machine.txt (date, tree, CPUs, GPU,
#                    versions, FA3, FA4). Returns non-zero if an install fails.
# gpu_tests OUT DEFAULT   pytest of $TESTS (unset: DEFAULT; 0 or empty: none; `all`: GPU_TESTS, every test that
#                    uses the GPU where there is one) and $MORE_TESTS, into OUT/gpu_tests.log; prints its tail.
# gpu_imports OUT TREE...  imports every module of each checkout, so a missing wheel fails in seconds, not
#                    after a server's retries. Returns non-zero, with the error, if one fails.
#
# FA4's CUDA 13 library wheel (92 MB) is over what one call carries: .fa4 holds it without its two large files,
# one of them xz-packed beside it (libcute_dsl_runtime.so.xz), and the other (the CuTe DSL's pybind module,
# 50 MB packed) comes in an earlier call to the same warm machine as .fa4a/cutlass_ir.so.xz, which gpu_setup
# unpacks into /tmp/fa4lib (kept between calls; the checkout's untracked folders are not): first
# `. bench/gpu_common.sh && gpu_setup /tmp/o` with .fa4a carried, then the run with .whl .fa3 .fa4.

GPU_TESTS="tests/unit/engine/test_core_cuda.py tests/unit/engine/test_tower_cuda.py tests/unit/engine/test_attention_cuda.py
  tests/unit/engine/test_attention.py tests/unit/engine/test_tower.py tests/unit/engine/test_pool.py tests/unit/engine/test_runner.py
  tests/unit/engine/test_graphs.py tests/unit/kernels tests/unit/media/test_images.py tests/unit/store"

_unxz() { python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2"; }

_mooncake_libs() {  # LD_LIBRARY_PATH for the libraries Mooncake links that this machine lacks, from .mc's packages
  local out=$1 so=/tmp/site/mooncake/store.so libs="" pass missing deb d lib found
  for pass in 1 2 3; do  # (a library added may need another the machine lacks)
    missing=$(LD_LIBRARY_PATH=$libs ldd $so /tmp/site/mooncake/mooncake_master | awk '/not found/ {print $1}' | sort -u)
    [ -z "$missing" ] && break
    echo "pass $pass, missing: $missing" >> "$out/libs.log"
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
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >> "$out/libs.log"
  python3 -c "import mooncake.store, service.store.mooncake" >> "$out/libs.log" 2>&1 || { tail -5 "$out/libs.log"; return 1; }
}

gpu_setup() {
  local out=$1 d
  mkdir -p "$out"
  # The tree is not installed here: its kernels package (kernels/qve_kernels) is found through the path.
  export PYTHONPATH=$PWD/kernels
  for d in .whl .fa3 .fa4 .wav .mc; do
    if ls "$d"/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
        >> "$out/pip.log" 2>&1 || { tail -5 "$out/pip.log"; return 1; }
      export PYTHONPATH=$PWD/kernels:/tmp/site PATH=/tmp/site/bin:$PATH
    fi
  done
  if [ -f .fa4a/cutlass_ir.so.xz ]; then
    mkdir -p /tmp/fa4lib && _unxz .fa4a/cutlass_ir.so.xz /tmp/fa4lib/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so || return 1
  fi
  if [ -f .fa4/libcute_dsl_runtime.so.xz ] && [ -d /tmp/site/nvidia_cutlass_dsl ]; then
    _unxz .fa4/libcute_dsl_runtime.so.xz /tmp/site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so || return 1
    cp /tmp/fa4lib/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so /tmp/site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/ \
      || echo "FA4: /tmp/fa4lib holds no CuTe DSL module: send .fa4a/ first (gpu_setup with it carried)" >&2
    export PYTHONPATH=$PWD/kernels:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages  # its .pth is not read under --target
  fi
  if [ -f /tmp/site/mooncake/store.so ] && ls .mc/*.deb >/dev/null 2>&1; then
    _mooncake_libs "$out" || return 1
  fi
  export PYTHONUNBUFFERED=1
  { date -u; git log -1 --format='tree %h %s' 2>/dev/null; nproc;
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv;
    python3 -c "import importlib, torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__)
for name in ('torchvision', 'av', 'mooncake'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', 'installed'))
    except ImportError:
        print(name, 'not installed')
from service.engine import attention; print('FA3', attention.fa3_status()); print('FA4', attention.fa4_status())"; } \
    > "$out/machine.txt" 2>&1
  return 0  # (machine.txt says what was missing)
}

gpu_tests() {
  local out=$1 want=${TESTS-$2}
  [ "$want" = 0 ] && want=""
  [ "$want" = all ] && want=$GPU_TESTS
  if [ -z "$want${MORE_TESTS:-}" ]; then
    return 0
  fi
  # shellcheck disable=SC2086  (lists of paths)
  timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -rs $want ${MORE_TESTS:-} \
    > "$out/gpu_tests.log" 2>&1
  tail -25 "$out/gpu_tests.log"
}

gpu_imports() {
  local out=$1 tree
  shift
  # (all but vLLM's connector: vLLM is not on the GPU machines, and nothing measured there runs it)
  for tree in "$@"; do
    (cd "$tree" && python3 -c "import importlib, pkgutil, service
for m in pkgutil.walk_packages(service.__path__, 'service.'):
    if m.name != 'service.lm.vllm_connector': importlib.import_module(m.name)") \
      > "$out/imports.log" 2>&1 || { echo "imports fail in $tree:"; tail -5 "$out/imports.log"; return 1; }
  done
}
