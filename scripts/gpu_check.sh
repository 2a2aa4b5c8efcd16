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

# Step limits add up to 530 s (one device call may run 600 s): the CPU-only tests are CI's job,
# here only the kernels and the GPU tests. CSVs only (at most 8 files come back); draw the
# plots afterwards with `python benchmarks/report.py DIR --plot`.
step build 90 python -m pip install --no-build-isolation --no-deps -e . || exit 1
step info 20 python -m fusedattn.info
step tests 240 python -m pytest -q -rs -m "gpu or kernels" tests
step bench 180 python benchmarks/run_all.py --quick --no-plots \
  --only attention,layernorm,softmax --out "$out_dir"
echo "== gpu-check done: status $status; files in $out_dir"
exit "$status"
