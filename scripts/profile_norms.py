"""Where the Triton norms' training step loses time (issue #14): on the H100 their fwd+bwd took
0.2-0.5 ms more than their forward plus their backward timed apart, and the CUDA kernels'
did not (benchmarks/results/h100/README.md). For each op and backend, one fwd+bwd step at the
benchmark's size (bf16, 256 MB input): the wall time per step (10 steps, under the profiler),
the GPU time of each kernel, their sum, and the host calls that can stall a stream (cudaMalloc,
cudaFree, synchronisations) with their counts. A wall time well above the kernel sum with
no stalls says host-bound; stalls say the allocator.

    python3 scripts/profile_norms.py [--n 4096] [--ops layer_norm,rms_norm,softmax]
"""

import argparse
import sys
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType

import fusedattn

STALLS = ("cudaMalloc", "cudaFree", "cudaDeviceSynchronize", "cudaStreamSynchronize",
          "cudaEventSynchronize", "cudaMemcpy")  # fmt: skip
INPUT_BYTES = 256 * 2**20


def make_step(op: str, backend: str, x: torch.Tensor, dy: torch.Tensor):
    n = x.shape[-1]
    w = torch.randn(n, device=x.device, dtype=x.dtype, requires_grad=True)
    b = torch.randn(n, device=x.device, dtype=x.dtype, requires_grad=True)

    def step():
        if op == "layer_norm":
            y = fusedattn.layer_norm(x, (n,), w, b, 1e-5, backend=backend)
            inputs = (x, w, b)
        elif op == "rms_norm":
            y = fusedattn.rms_norm(x, (n,), w, 1e-6, backend=backend)
            inputs = (x, w)
        else:
            y = fusedattn.softmax(x, -1, backend=backend)
            inputs = (x,)
        return torch.autograd.grad(y, inputs, dy)

    return step


def profile(op: str, backend: str, n: int, device: torch.device, steps: int = 10) -> None:
    on_gpu = device.type == "cuda"
    rows = INPUT_BYTES // (2 * n) if on_gpu else 64  # off a GPU: a dry run of this code
    dtype = torch.bfloat16 if on_gpu else torch.float32
    x = torch.randn(rows, n, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    step = make_step(op, backend, x, dy)
    for _ in range(3):  # compile, allocate
        step()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - began) * 1e3 / steps
    # GPU kernels only (a CPU op's device time includes its kernels: no double counting)
    kernel_us = defaultdict(float)
    stalls = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernel_us[e.name] += e.device_time
        elif e.name.startswith(STALLS):
            stalls[e.name][0] += 1
            stalls[e.name][1] += e.cpu_time
    total = sum(kernel_us.values()) / steps / 1e3
    print(f"== {op} {backend} N={n} rows={rows}: wall {wall:.3f} ms per step "
          f"(includes the profiler), GPU kernels {total:.3f} ms")  # fmt: skip
    for name, us in sorted(kernel_us.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {us / steps / 1e3:8.3f} ms  {name[:100]}")
    for name, (count, us) in stalls.items():
        print(f"  host {name}: {count / steps:.1f} per step, {us / steps / 1e3:.3f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="4096", help="row lengths, comma-separated")
    parser.add_argument("--ops", default="layer_norm,rms_norm,softmax")
    parser.add_argument("--backends", default="torch,triton,cuda")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        print("no CUDA device: a dry run on 64 fp32 rows (Triton: TRITON_INTERPRET=1)")
    for n in (int(v) for v in args.n.split(",")):
        for op in args.ops.split(","):
            for backend in args.backends.split(","):
                profile(op, backend, n, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
