#!/usr/bin/env bash
# The prepared GPU calls: build fusedattn._C for this card, run the GPU tests, time the kernels,
# and write logs and CSVs into the folder given (default $OUT, else .make/gpu-check). No
# network is assumed: nothing is downloaded (a Liger-Kernel wheel carried in .whl/ is
# installed for the norm baselines). Each step has a time limit; a failing step does not stop
# the others. GPU_CHECK_STEPS picks steps, in this order; three presets:
#   next    what issue #74 (the GPU run-book) has first and undone, in one call of at most 8
#           minutes (GPU_CHECK_DEADLINE=470). Today: build, info, the whole GPU test grid
#           again (item 1: on the H200 on 2026-11-28 1018 of 1022 passed in 159 s; the 4
#           failures were fixed after that run, unrun on a GPU), profile-bert512 (padded BERT
#           at T=512 ran 0.70x fusedattn-torch under auto; now against plain SDPA and the
#           torch backend without its K/V copy), first-use and bench-cp (item 7: the ring's
#           blocks and, since issue #72, a Ulysses rank's call at W = 2, 4, 8). Then the
#           presets hopper, fp8, models (item 4). Move it on as the items get done.
#   check   (default) build info bench-attention gpu-tests (on the H200, 2026-11-27, one
#           call with GPU_CHECK_DEADLINE=555: build 61 s, bench-attention 172 s, the tests
#           cut at 300 s with 444 of the 600 Triton tests and all 200 CUDA ones run, before
#           the tests ran on work-stealing workers)
#   measure build tune-triton bench-norms bench-model host (fits one call)
#   hopper  build tune-hopper tiles bench-attention (issue #61, one call of at most 8 minutes
#           with GPU_CHECK_DEADLINE=470: every Triton tile candidate — the pipelined (p) and
#           warp-specialized (w) forwards among them — checked against float64 on the GPU,
#           then timed against the shipped tiles and SDPA's cuDNN and flash at D 64/128,
#           T 1k/4k/16k, causal or not; build_tile_table.py writes the winners into
#           triton_kernels/attention_tiles.py (a copy in OUT to commit) and bench-attention
#           times the whole op with them for auto's table; a second call if it was cut)
#   models  build info bench-models profile-bert512 (issue #70, one call of at most 8
#           minutes with GPU_CHECK_DEADLINE=470): fusedattn against what users run —
#           Hugging Face GPT-2, padded BERT and a Llama-3-shaped decoder with transformers'
#           eager/sdpa (flash_attention_2 where installed) against fusedattn's hook, and the
#           reference transformer on plain SDPA against auto — eager and torch.compile'd,
#           each (model, impl) in a process of its own, the compiled ones compiled first in
#           4 parallel processes; auto against the user baselines first, so a cut run keeps
#           those (model.csv streamed row by row). Then the profile of padded BERT at T=512,
#           auto against plain SDPA and fusedattn's torch backend: where any loss is.
#   flex    build flex-tests bench-flex (issue #71, one call of at most 8 minutes with
#           GPU_CHECK_DEADLINE=470): the block-mask tests on the compiled kernels (every
#           pattern against float64, forward and gradients), then benchmarks/bench_flex.py:
#           create_block_mask at 128k (fusedattn's eager against Flex's compiled), and
#           document masks (4 and 16 documents), prefix-LM and causal at T = 8k, 16k, 32k,
#           D=128, bf16, forward and fwd+bwd against Flex compiled, varlen over the same
#           documents and is_causal (targets: >= 1.2x Flex, within 10 % of varlen, 5 % of
#           is_causal)
#   flex-mods build flex-mod-tests bench-flex-mods (issue #84, one call of at most 8 minutes
#           with GPU_CHECK_DEADLINE=470): test_score_mod.py, test_flex_api.py and the launch
#           cache's tests on the compiled kernels, then benchmarks/bench_flex.py --part mods:
#           softcap, ALiBi and a relative bias as score_mods and the table learnable, causal,
#           B=2, T = 4k and 16k, D=128, bf16, fwd and fwd+bwd, against Flex compiled (same mod,
#           causal block mask) and the built-in softcap= / alibi_slopes=, and a new mod's
#           first call (targets: pointwise mods >= Flex, learnable within 1.1x of it, a mod
#           equal to a built-in within 5 %, first call <= 10 s); last, if the deadline
#           leaves time, bench_host.py's real-launch host costs (the planned block-mask and
#           score_mod rows against the plain call: issue #84's "a few µs" on the GPU host)
#   invariant build invariant-tests bench-invariant (issue #73, one call of at most 8 minutes):
#           the batch-invariance bit-equality tests on the compiled kernels (split size 64
#           keys so the tests' caches cross splits), then decode with fusedattn.batch_invariant
#           off and on at B = 1, 8, 64 over 8k and 32k caches, each "on" row checking sequence
#           0's bits alone against in the batch (targets: <= 10 % slower at B >= 8; B=1 32k
#           >= 70 % of the copy rate); fusedattn.linear's invariant matmul against cuBLAS on
#           Llama-3-8B's projections at M = 1, 8, 64, 4096 (tests/test_linear.py runs first)
#   mla     build mla-tests bench-mla (issue #83, one call of at most 8 minutes): the MLA
#           tests on the compiled latent kernel (DeepSeek's 512 + 64, pages 1 to 64, fp8,
#           splits, batch invariance, the 192/128 prefill through varlen_attention), then
#           benchmarks/bench_mla.py: decode at Hq = 16 and 128, B = 1, 8, 64, 128, caches of
#           4k and 32k, bf16 and fp8, pages 64 and 16, against the copy rate, the 2176 FLOP per
#           key x head arithmetic and vLLM's TRITON_MLA kernel where vLLM is installed
#           (targets: memory-bound >= 80 % of copy, Hq = 128 >= 330 TFLOP/s, fp8 >= 1.7x bf16
#           at B >= 8)
#   mla-sparse build mla-sparse-tests bench-mla-sparse (issue #85, one call of at most 8
#           minutes): the sparse tests on the compiled kernel, then bench_mla.py --part sparse:
#           decode over 2048 listed keys at B = 1, 32, 128, Hq = 16 and 128, Tq = 1 and 2,
#           caches of 8k and 32k, bf16, fp8 and 656-byte rows, and the sparse prefill at 8k
#           (targets: fp8 at B = 128, Hq = 128, Tq = 2 >= 200 TFLOP/s; memory-bound >= 70 % of
#           copy over the gathered bytes)
#   fp8     build fp8-tests bench-fp8 (issue #60, one call of at most 8 minutes: the fp8
#           tests on the GPU's own fp8 conversions and tensor cores, then decoding over an
#           fp8 cache and the fp8 forward against bf16 and SDPA, benchmarks/bench_fp8.py)
# and, on request only, profile (per-kernel times and an ncu report of the CUDA attention),
# tune-cuda (the CUDA attention tile variants, FUSEDATTN_TUNING=1), tune-cuda-bwd (the CUDA
# attention's fused backward against its two-kernel one, ~60 s), tune-norms (the Triton
# LayerNorm/RMSNorm/softmax warp counts and backward row paths), profile-norms (where the
# Triton norms' fwd+bwd loses 0.2-0.5 ms on the H100: kernels, allocator, host),
# tune-triton-masks (the Triton kernels with a dense bool or float attn_mask, ~3 x 26
# candidates: the masked loops reshaped without a GPU; CSV under masks/), bench-decode
# (attention_with_kvcache against SDPA, Flex, the prefill kernel; generate tokens/s),
# bench-cp (context parallelism's block calls for W = 4 and 8 against one whole call),
# profile-model (auto's choices, step time and top kernels of each swapped model variant),
# tune-decode (the decode kernel's key splits against half, 2x and 4x, ~60 s), first-use
# (issue #17: an installed wheel without _C, backend="cuda" compiling it on first use), vllm
# (issue #62: vLLM serving on fusedattn against its default backend, if vLLM is installed).
#
#   bash scripts/gpu_check.sh OUT_DIR            (or: make gpu-check OUT=OUT_DIR)
#   GPU_CHECK_STEPS=measure bash scripts/gpu_check.sh OUT_DIR
#   GPU_TESTS_PART=1/2 GPU_CHECK_STEPS="build gpu-tests" ...   (the Triton grid's second half)
#   GPU_CHECK_DEADLINE=560 ...   (every step ends by 560 s after the start: one device call)
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-${OUT:-.make/gpu-check}}
mkdir -p "$out_dir"
exec > >(tee "$out_dir/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}  # the GPU image has python3 only
case "${GPU_CHECK_STEPS:-check}" in
  next) steps=" build info gpu-tests profile-bert512 first-use bench-cp " ;;  # see above
  check) steps=" build info bench-attention gpu-tests " ;;
  measure) steps=" build tune-triton bench-norms bench-model host " ;;
  fp8) steps=" build fp8-tests bench-fp8 " ;;
  hopper) steps=" build tune-hopper tiles bench-attention " ;;
  models) steps=" build info bench-models profile-bert512 " ;;
  flex) steps=" build flex-tests bench-flex " ;;
  flex-mods) steps=" build flex-mod-tests bench-flex-mods host-flex " ;;
  invariant) steps=" build invariant-tests bench-invariant " ;;
  mla) steps=" build mla-tests bench-mla " ;;
  mla-sparse) steps=" build mla-sparse-tests bench-mla-sparse " ;;
  *) steps=" ${GPU_CHECK_STEPS} " ;;
esac
status=0

# GPU_CHECK_DEADLINE=S (seconds from the script's start; default none) caps every step's limit
# at the time left, so one device call can hold several steps and still end inside its own
# limit with every step's log written (a call killed from outside loses the shard logs).
deadline=${GPU_CHECK_DEADLINE:-0}

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc left
  shift 2
  [[ $steps == *" ${name%%:*} "* ]] || return 0  # profile:ncu runs with "profile"
  if ((deadline > 0)); then
    left=$((deadline - SECONDS))
    if ((left < 15)); then
      echo "== $name: not run, ${left}s left before GPU_CHECK_DEADLINE=${deadline}"
      status=1
      return 1
    fi
    ((left < limit)) && limit=$left
  fi
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" bash -c '"$@"' _ "$@"  # bash -c: a step may be a function of this script
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

# N pytest processes over one test selection (every N-th test each): the Triton kernels of
# the test grid compile in parallel on the machine's cores. One log per selection in $out_dir
# (the device tool returns 8 files at most: per-shard logs did not all come back), written
# also when the step's time limit stops the shards.
# -v: every test's name and outcome as it ends, so a shard the time limit stops still says
# which tests failed (with -q the H100 run's cut shards showed 8 failures and no names).
# --durations: the slowest tests of each finished shard (Triton compiles), to trim the grid by.
# PART=k/m (default 0/1) runs part k of m of the selection: SHARDS processes take shards
# k, k + m, ... of SHARDS x m, so m device calls cover a selection one call cannot.
sharded_pytest() {  # sharded_pytest NAME SHARDS PYTEST_ARGS...
  local name=$1 shards=$2 pids=() rc=0 logs part=${PART:-0/1}
  local k=${part%/*} m=${part#*/}
  shift 2
  logs=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: the trap runs after the locals are gone
  trap "for f in $logs/*.log; do echo \"==> \$f\"; cat \"\$f\"; done >'$out_dir/$name.log'; exit 124" TERM
  for ((i = 0; i < shards; i++)); do
    $PYTHON -m pytest -v -rs --tb=short --durations=15 --shard "$((i * m + k))/$((shards * m))" "$@" \
      >"$logs/$i.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  for f in "$logs"/*.log; do echo "==> shard $(basename "$f" .log) of $shards"; cat "$f"; done \
    >"$out_dir/$name.log"
  tail -q -n 1 "$logs"/*.log
  grep -h "^FAILED\|^ERROR" "$logs"/*.log | head -40
  return "$rc"
}

# The GPU test selection. With pytest-xdist (the GPU image has it): one pytest over the Triton
# and CUDA selections together on 15 workers that take tests as they free up (--dist
# worksteal), so no core idles while another worker has a queue of slow Triton compiles; on
# the H200 (2026-11-27) the fixed shards below finished 3 of 11 in 300 s (one shard ran 16 of
# its 55 tests) while the 4 CUDA processes sat idle after 105 s. A CUDA fault kills one
# worker, which xdist reports and replaces. The log is written as tests end, so the step's
# time limit keeps every outcome so far.
# Without xdist, the Triton and CUDA selections at once in fixed shards (11 + 4 processes):
# on the H100 the Triton grid alone did not finish in 240 s on 8 processes, nor in 300 s on
# 11 (about 330 of its 547 tests ran; the CUDA tests, 200, took 105 s beside it).
# GPU_TESTS_PART=0/2 and 1/2 split the selection over two calls (the shard-based fallback
# runs the CUDA tests in the first).
gpu_tests() {  # (the selections live here: a step runs in a new bash, which no array reaches)
  local rc=0 part=${GPU_TESTS_PART:-0/1}
  local triton_tests=(tests/test_attention.py tests/test_attention_tma.py
    tests/test_attention_variants.py tests/test_empty_inputs.py tests/test_layernorm.py
    tests/test_rmsnorm.py tests/test_softmax.py tests/test_swap.py tests/test_decode.py
    tests/test_decode_values.py tests/test_paged_prefill.py tests/test_cuda_graphs.py
    tests/test_fp8.py tests/test_huggingface_fp8.py)
  local cuda_tests=(tests/test_cuda_attention.py tests/test_cuda_attention_fused_bwd.py
    tests/test_gpu_backends.py tests/test_dispatch.py tests/test_auto.py)
  if $PYTHON -c "import xdist" 2>/dev/null; then
    local shard=()
    [[ ${part#*/} == 1 ]] || shard=(--shard "$part")
    $PYTHON -m pytest -n "${GPU_TEST_WORKERS:-15}" --dist worksteal -v -rs --tb=short \
      --durations=25 "${shard[@]}" -m "gpu or kernels" "${triton_tests[@]}" "${cuda_tests[@]}" \
      >"$out_dir/gpu-tests.log" 2>&1
    rc=$?
    tail -n 1 "$out_dir/gpu-tests.log"
    grep -h "^FAILED\|^ERROR\| FAILED \| ERROR \|crashed" "$out_dir/gpu-tests.log" | head -40
    return "$rc"
  fi
  PART=$part sharded_pytest triton 11 -m "gpu or kernels" "${triton_tests[@]}" &
  local triton=$! cuda=
  # The CUDA C++ kernels in their own processes: a kernel fault cannot take the rest down.
  if [[ ${part%/*} == 0 ]]; then
    PART=0/1 sharded_pytest cuda 4 -m "gpu or kernels" "${cuda_tests[@]}" &
    cuda=$!
  fi
  trap 'kill -TERM $triton $cuda 2>/dev/null; wait; exit 124' TERM
  wait "$triton" || rc=1
  if [[ -n $cuda ]]; then wait "$cuda" || rc=1; fi
  return "$rc"
}

vllm_serving() {
  if ! $PYTHON -c "import vllm" 2>/dev/null; then
    echo "vllm: not installed on this machine, nothing served (the step needs vLLM's CUDA build)"
    return 3
  fi
  $PYTHON -c "import vllm; print('vllm', vllm.__version__)"
  $PYTHON benchmarks/bench_vllm.py --quick --out "$out_dir"
}

export -f sharded_pytest gpu_tests vllm_serving
export out_dir PYTHON

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
# Compile for this card only (the default list also builds sm_80): halves the build.
arch=$($PYTHON -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m == 9 else ''))")
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
export MAX_JOBS=${MAX_JOBS:-16}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FUSEDATTN_FORCE_CUDA_BUILD=1 FUSEDATTN_EXPECT_CUDA_BUILD=1
[[ $steps == *" tune-cuda "* ]] && export FUSEDATTN_TUNING=1

# CSVs only; draw the plots afterwards with `python benchmarks/report.py DIR --plot`, and
# rebuild auto's table with scripts/build_auto_table.py. The CPU-only tests are CI's job.
# pyproject's SPDX license string needs setuptools 77; an older one in the image (no network
# to upgrade it) builds from the table form instead, in this copy of the tree only.
if ! $PYTHON -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"; then
  echo "setuptools < 77 here: building with pyproject's license as a table"
  sed -i 's/^license = "BSD-3-Clause"$/license = { text = "BSD-3-Clause" }/' pyproject.toml
fi
step build 150 $PYTHON -m pip install --no-build-isolation --no-deps -e . || exit 1
step info 20 $PYTHON -m fusedattn.info
# issue #61: the tile candidates against float64, the shipped tiles and cuDNN/flash; then the
# tile table from the winners (the tree's copy, so bench-attention below runs them)
step tune-hopper 300 $PYTHON scripts/tune_triton_attention.py --cases d128,d128c,d64,d64c \
  --lengths 1024,4096,16384 --baselines --jobs 16 --out "$out_dir"
step tiles 20 bash -c "$PYTHON scripts/build_tile_table.py '$out_dir/tune_triton_attention.csv' \
  && cp triton_kernels/attention_tiles.py '$out_dir/'"
# The whole-op attention benchmark first: auto's attention routing waits on it (issue #15).
# 19 cases. On the H100 (2026-11-26) the T=1024 half alone filled 200 s; by our estimate
# most of it Triton compiling 30-50 kernel specialisations one after another (~3.5 s each
# for sm_90 on the CPU machine, not profiled on the GPU one); run_all now compiles them in 16
# processes first (--compile-jobs) and writes each row as it is measured, so a cut run still
# leaves its CSV.
step bench-attention 240 $PYTHON benchmarks/run_all.py --quick --no-plots --only attention \
  --out "$out_dir"
# 450 s: about 600 Triton + 200 CUDA tests at ~7 s each (H200 shards, mostly Triton compiling)
# over 15 workers; GPU_CHECK_DEADLINE cuts it to what the call has left
step gpu-tests 450 gpu_tests
step bench-decode 300 $PYTHON benchmarks/run_all.py --quick --no-plots --only decode \
  --out "$out_dir"
# issue #60: the fp8 kernels on the GPU's own fp8 conversions (the CPU interpreter decodes
# fp8 by hand), then their speed against bf16 and SDPA (quick grid: ~40 timed points)
step fp8-tests 150 $PYTHON -m pytest -n "${GPU_TEST_WORKERS:-15}" -q -rs --tb=short \
  -m "gpu or kernels" tests/test_fp8.py tests/test_huggingface_fp8.py
step bench-fp8 240 $PYTHON benchmarks/run_all.py --quick --no-plots --only fp8 --out "$out_dir"
step bench-cp 240 $PYTHON benchmarks/bench_context_parallel.py --out "$out_dir"
# issue #71: block masks on the compiled kernels, then against Flex (compiled) and varlen
step flex-tests 150 $PYTHON -m pytest -n "${GPU_TEST_WORKERS:-15}" -q -rs --tb=short \
  tests/test_block_mask.py
step bench-flex 300 $PYTHON benchmarks/bench_flex.py --part masks --out "$out_dir"
# issue #84: score_mods and torch's BlockMask API on the compiled kernels (every op of the
# subset, learnable tables, the launch cache's per-call keywords), then the mods against Flex
# compiled and the built-ins, and a new mod's first call
step flex-mod-tests 150 $PYTHON -m pytest -n "${GPU_TEST_WORKERS:-15}" -q -rs --tb=short \
  tests/test_score_mod.py tests/test_flex_api.py tests/test_triton_launch.py
step bench-flex-mods 300 $PYTHON benchmarks/bench_flex.py --part mods --out "$out_dir"
# issue #73: batch invariance on the compiled kernels, then its price for decoding
step invariant-tests 150 env FUSEDATTN_SPLIT_KEYS=64 $PYTHON -m pytest \
  -n "${GPU_TEST_WORKERS:-15}" -q -rs --tb=short tests/test_batch_invariance.py tests/test_linear.py
step bench-invariant 240 $PYTHON benchmarks/bench_invariant.py --out "$out_dir"
step mla-tests 150 $PYTHON -m pytest -n "${GPU_TEST_WORKERS:-15}" -q -rs --tb=short \
  tests/test_mla.py
step bench-mla 300 $PYTHON benchmarks/bench_mla.py --out "$out_dir"
# issue #85: DeepSeek sparse attention on the compiled kernel, then its decode and prefill rows
step mla-sparse-tests 150 $PYTHON -m pytest -n "${GPU_TEST_WORKERS:-15}" -q -rs --tb=short \
  tests/test_mla_sparse.py
step bench-mla-sparse 300 $PYTHON benchmarks/bench_mla.py --part sparse --out "$out_dir"
# issue #17: a wheel without _C (as `pip install .` builds it), backend="cuda" compiling on first use
step first-use 240 bash scripts/first_use_check.sh "$(mktemp -d)"
# issue #62: vLLM's CUDA build serving a random Llama (Llama-3-8B's attention, 8 layers) on
# its default backend and on fusedattn's (attention_backend="CUSTOM"), B 1/16/64: tokens/s
# and greedy agreement (benchmarks/bench_vllm.py, vllm.csv). The CUDA image had no vLLM
# (KINDS.md, 2026-11-17) and its wheel with its own torch is far over what a call carries.
step vllm 420 vllm_serving
# the decode kernel's key splits: the chosen count against half, 2x, 4x, from CUDA graphs
step tune-decode 120 $PYTHON scripts/tune_decode.py --out "$out_dir"
step tune-triton 180 $PYTHON scripts/tune_triton_attention.py --out "$out_dir" --jobs 16
step tune-triton-masks 180 $PYTHON scripts/tune_triton_attention.py --cases d128m,d128cm,d128cmf \
  --out "$out_dir/masks" --jobs 16
if [[ $steps == *" bench-norms "* ]] && ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
  $PYTHON -m pip install --no-deps --no-index .whl/liger_kernel-*.whl || true
fi
step bench-norms 200 $PYTHON benchmarks/run_all.py --quick --no-plots \
  --only layernorm,rmsnorm,softmax --out "$out_dir"
step bench-model 200 $PYTHON benchmarks/run_all.py --quick --no-plots --only model \
  --out "$out_dir"
# issue #70: the models against what users run, every group in a process of its own; the
# benchmark stops starting groups at its --deadline (the step's limit less the profile's 60 s)
bench_models_limit=330
((deadline > 0)) && bench_models_limit=$((deadline - SECONDS - 70))
step bench-models 330 $PYTHON benchmarks/bench_model.py --quick --out "$out_dir" \
  --compile-jobs 4 --deadline "$((bench_models_limit > 30 ? bench_models_limit : 30))"
# host: real launches at tiny shapes, the launch cache off then on (one CSV, labelled)
step host 60 env FUSEDATTN_TRITON_LAUNCH_CACHE=0 $PYTHON benchmarks/bench_host.py \
  --label " (launch cache off)" --out "$out_dir"
step host:cache 60 $PYTHON benchmarks/bench_host.py --label " (launch cache on)" --out "$out_dir"
# issue #84: the planned flex calls' host cost with real launches (fusedattn's rows only)
step host-flex 60 $PYTHON benchmarks/bench_host.py --impl fusedattn-triton --out "$out_dir"
if [[ $steps == *" profile "* ]]; then
  step profile 60 $PYTHON scripts/profile_attention.py
  step profile:causal 40 $PYTHON scripts/profile_attention.py --causal
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  step profile:ncu 120 "$ncu" --clock-control none -k 'regex:attention_(fwd|bwd_dq|bwd_dkdv)_kernel' \
    -c 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --log-file "$out_dir/ncu.txt" $PYTHON scripts/profile_attention.py --ncu
fi
step tune-cuda 120 $PYTHON scripts/tune_attention.py --out "$out_dir"
step tune-cuda-bwd 120 $PYTHON scripts/tune_cuda_backward.py --out "$out_dir"
step tune-norms 240 $PYTHON scripts/tune_norms.py --out "$out_dir"
step profile-norms 120 $PYTHON scripts/profile_norms.py --n 1024,4096,32768
# Why auto's inference rows trailed torch on the H200 (model.csv, 2026-11-27): auto's choices,
# step times and top kernels of each swapped variant
step profile-model 100 $PYTHON scripts/profile_model.py --model gpt2-small --T 512
step profile-model:bert 100 $PYTHON scripts/profile_model.py --model bert-base-padded --T 2048
# padded BERT at T=512 (B=32): auto 15.70 against fusedattn-torch 10.93 ms on the H200
# (2026-11-28), fusedattn-cuda 9.11; against plain SDPA (what a user runs) and fusedattn's own
# torch backend (no K/V copy since issue #70): where any loss is
step profile-bert512 60 $PYTHON scripts/profile_model.py --model bert-base-padded --T 512 \
  --impls sdpa,auto,fusedattn-torch
echo "== gpu-check done: status $status; files in $out_dir"
exit "$status"
