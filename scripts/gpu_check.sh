#!/usr/bin/env bash
# The one prepared GPU call: build fusedattn._C for this card, run the GPU tests and the quick
# benchmarks, and write logs and CSVs into the folder given (default $OUT, else
# build/gpu-check). No network is assumed: nothing is downloaded. Each step has a time limit
# so the whole run stays well inside 8 minutes; a failing step does not stop the others.
#
#   bash scripts/gpu_check.sh OUT_DIR        (or: make gpu-check OUT=OUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-${OUT:-build/gpu-check}}
mkdir -p "$out_dir"
exec > >(tee "$out_dir/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
# Compile for this card only (the default list also builds sm_80): halves the build.
arch=$(python -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m == 9 else ''))")
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
export MAX_JOBS=${MAX_JOBS:-16}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FUSEDATTN_FORCE_CUDA_BUILD=1 FUSEDATTN_EXPECT_CUDA_BUILD=1

# Limits add up to 8.5 minutes; the CPU-only tests are CI's job, here only kernels and GPU tests.
step build 120 python -m pip install --no-build-isolation --no-deps -e . || exit 1
step info 30 python -m fusedattn.info
step tests 270 python -m pytest -q -rs -m "gpu or kernels" tests
step bench 90 python benchmarks/run_all.py --quick --only layernorm,softmax --out "$out_dir"
step bench-attention 180 python benchmarks/run_all.py --quick --only attention --out "$out_dir"
echo "== gpu-check done: status $status; files in $out_dir"
exit "$status"
