#!/usr/bin/env bash
# What `pip install .` gives a user on a GPU machine (issue #17): a wheel without fusedattn._C
# (pip's isolated build environment has no torch, so setup.py skips the extension; emulated
# here with FUSEDATTN_SKIP_CUDA_BUILD=1, as tests/test_packaging.py does on the CPU), installed
# outside the checkout; the first call with backend="cuda" compiles the extension into the
# per-user cache, runs attention and LayerNorm on the GPU against SDPA and F.layer_norm, and a
# second process loads the cached build without compiling. Needs a GPU, nvcc and no network.
#
#   bash scripts/first_use_check.sh [WORK_DIR]        (gpu_check.sh step first-use)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
mkdir -p "$work"
# gpu_check.sh forces the ahead-of-time build for its own install; a user's pip does not
unset FUSEDATTN_FORCE_CUDA_BUILD FUSEDATTN_EXPECT_CUDA_BUILD
FUSEDATTN_SKIP_CUDA_BUILD=1 $PYTHON -m pip wheel -q --no-build-isolation --no-deps \
  -w "$work/dist" "$root"
wheel=$(ls "$work"/dist/fusedattn-*.whl)
if $PYTHON -c "import sys, zipfile; sys.exit(not any(n.startswith('fusedattn/_C') for n in zipfile.ZipFile(sys.argv[1]).namelist()))" "$wheel"; then
  echo "the wheel holds fusedattn/_C: not what pip's isolated build gives" >&2
  exit 1
fi
$PYTHON -m pip install -q --no-deps --target "$work/site" "$wheel"
cd "$work"  # not the checkout: the installed package, not the sources
export PYTHONPATH="$work/site" FUSEDATTN_CACHE_DIR="$work/cache"
$PYTHON -m fusedattn.info | grep "fusedattn._C"
check='
import sys, time, torch, torch.nn.functional as F
import fusedattn
from fusedattn.ops.core import backends
assert fusedattn.__file__.startswith(sys.argv[1]), fusedattn.__file__
q, k, v = (torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
start = time.perf_counter()
out = fusedattn.attention(q, k, v, is_causal=True, backend="cuda")
torch.cuda.synchronize()
print(f"first backend=\"cuda\" call: {time.perf_counter() - start:.1f} s, extension: "
      f"{backends.EXTENSION_ORIGIN} ({backends.extension().__file__})")
want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
err = (out.float() - want).abs().max().item()
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
w, b = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
ln = fusedattn.layer_norm(x, (4096,), w.bfloat16(), b.bfloat16(), backend="cuda")
want_ln = F.layer_norm(x.float(), (4096,), w.bfloat16().float(), b.bfloat16().float())
ln_err = (ln.float() - want_ln).abs().max().item()
print(f"attention max error vs fp32 SDPA {err:.2e}, LayerNorm vs fp32 {ln_err:.2e}")
assert err < 2e-2 and ln_err < 5e-2, (err, ln_err)
'
$PYTHON -c "$check" "$work/site"
# a new process: the cached build loads, nothing compiles
$PYTHON -c "$check" "$work/site" 2>&1 | tee "$work/second.txt"
grep -q "first-use build" "$work/second.txt"
if grep -q "compiling" "$work/second.txt"; then
  echo "the second process compiled again: the cache was not used" >&2
  exit 1
fi
echo "first-use check passed"
