#!/usr/bin/env bash
# The one prepared GPU call: build fusedattn._C for this card, run the GPU tests and the quick
# benchmarks, and write logs and CSVs into the folder given (default $OUT, else
# .make/gpu-check). No network is assumed: nothing is downloaded. Each step has a time limit
# so the whole run stays inside one device call (600 s); a failing step does not stop the
# others. GPU_CHECK_STEPS picks steps (default: all, in this order):
#   build info cuda-attention bench-attention tests bench-rowwise
# and, on request only, profile (per-kernel times and an ncu report of the CUDA attention) and
# tune (builds the attention tile variants, FUSEDATTN_TUNING=1, and times them).
#
#   bash scripts/gpu_check.sh OUT_DIR        (or: make gpu-check OUT=OUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-${OUT:-.make/gpu-check}}
mkdir -p "$out_dir"
exec > >(tee "$out_dir/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}  # the GPU image has python3 only
steps=" ${GPU_CHECK_STEPS:-build info cuda-attention bench-attention tests bench-rowwise} "
status=0

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  [[ $steps == *" ${name%%:*} "* ]] || return 0  # profile:ncu runs with "profile"
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
# Compile for this card only (the default list also builds sm_80): halves the build.
arch=$($PYTHON -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m == 9 else ''))")
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
export MAX_JOBS=${MAX_JOBS:-16}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FUSEDATTN_FORCE_CUDA_BUILD=1 FUSEDATTN_EXPECT_CUDA_BUILD=1
[[ $steps == *" tune "* ]] && export FUSEDATTN_TUNING=1

# CSVs only (at most 8 files come back); draw the plots afterwards with
# `python benchmarks/report.py DIR --plot`. The CPU-only tests are CI's job.
step build 150 $PYTHON -m pip install --no-build-isolation --no-deps -e . || exit 1
step info 20 $PYTHON -m fusedattn.info
# The CUDA attention first and in its own process: a kernel fault cannot take the rest down.
step cuda-attention 150 $PYTHON -m pytest -q -rs --maxfail=25 --tb=short tests/test_cuda_attention.py
step bench-attention 150 $PYTHON benchmarks/run_all.py --quick --no-plots --only attention \
  --out "$out_dir"
if [[ $steps == *" profile "* ]]; then
  step profile 60 $PYTHON scripts/profile_attention.py
  step profile:causal 40 $PYTHON scripts/profile_attention.py --causal
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  step profile:ncu 120 "$ncu" --clock-control none -k 'regex:attention_(fwd|bwd_dq|bwd_dkdv)_kernel' \
    -c 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --log-file "$out_dir/ncu.txt" $PYTHON scripts/profile_attention.py --ncu
fi
step tune 120 $PYTHON scripts/tune_attention.py --out "$out_dir"
# Verbose, so that a run cut short still shows which tests passed; the cheap families first.
step tests "${GPU_CHECK_TESTS_LIMIT:-240}" $PYTHON -m pytest -v -rs --tb=short -m "gpu or kernels" \
  tests/test_gpu_backends.py tests/test_layernorm.py tests/test_softmax.py tests/test_swap.py \
  tests/test_attention.py
step bench-rowwise 90 $PYTHON benchmarks/run_all.py --quick --no-plots \
  --only layernorm,softmax --out "$out_dir"
echo "== gpu-check done: status $status; files in $out_dir"
exit "$status"
