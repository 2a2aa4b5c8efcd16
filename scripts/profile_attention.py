"""Per-kernel GPU time of one attention forward + backward, for each kernel backend and SDPA's
flash backend (torch.profiler), at the ENVIRONMENT.md comparison point (B=4, H=16, T=4096,
D=128, bf16). Shows which kernel of a backward dominates before anyone tunes it.

    python3 scripts/profile_attention.py [--causal] [--ncu]

--ncu: run the cuda backend once (forward + backward) and nothing else, for
`ncu -k regex:attention ... python3 scripts/profile_attention.py --ncu`.
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedattn


def step(fn, q, k, v, causal):
    out = fn(q, k, v, causal)
    out.backward(torch.ones_like(out))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--shape", default="4,16,4096,128", help="B,H,T,D")
    args = parser.parse_args()
    B, H, T, D = (int(x) for x in args.shape.split(","))
    q, k, v = (
        torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )

    def fused(backend):
        return lambda q, k, v, c: fusedattn.attention(q, k, v, is_causal=c, backend=backend)

    def flash(q, k, v, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)

    impls = {"cuda": fused("cuda")}
    if not args.ncu:
        impls |= {"triton": fused("triton"), "sdpa-flash": flash}
    for name, fn in impls.items():
        for _ in range(1 if args.ncu else 3):  # warm-up: compile, autotune, allocate
            step(fn, q, k, v, args.causal)
        torch.cuda.synchronize()
        if args.ncu:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step(fn, q, k, v, args.causal)
            torch.cuda.synchronize()
        print(f"== {name} B={B} H={H} T={T} D={D} causal={args.causal}: per call, 5 calls")
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        for e in sorted(events, key=lambda e: -e.device_time_total)[:8]:
            print(f"  {e.device_time_total / 5 / 1e3:8.3f} ms  {e.key[:110]}")


if __name__ == "__main__":
    main()
