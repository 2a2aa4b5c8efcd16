"""Model level: the reference transformer's training step and inference, tokens/s and peak
memory: naive modules vs fusedattn's kernels (swap_modules(backend="triton")) vs torch's own
fused ops (swap_modules(backend="torch")).

    python benchmarks/bench_model.py [--quick] [--out DIR]

GPU: decoder-only at GPT-2-small size (12 x 768, 12 heads) and an encoder-decoder (6+6 x 512,
8 heads), bf16, B*T = 16k tokens, T = 512..8192; a naive run that does not fit is recorded as
"out of memory" (the O(T^2) story). CPU: a tiny decoder-only model, to show the harness.
The pass column compares each impl's logits with the naive model in float64 (k = 3), once
per model and impl at T = 128.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import harness
import torch

import fusedattn
from fusedattn.reference.transformer import Transformer, TransformerConfig


@dataclass(frozen=True)
class ModelCase:
    name: str
    cfg: TransformerConfig
    lengths: tuple[int, ...]
    tokens: int  # B * T per step
    dtype: torch.dtype


def cases(quick: bool, device: torch.device) -> list[ModelCase]:
    if device.type != "cuda":
        tiny = TransformerConfig(vocab_size=1000, d_model=128, n_heads=4, n_encoder_layers=0,
                                 n_decoder_layers=2, d_ff=512, dropout=0.0, max_len=256)  # fmt: skip
        return [ModelCase("tiny-decoder", tiny, (64, 128), 512, torch.float32)]
    lengths = (512, 2048) if quick else (512, 1024, 2048, 4096, 8192)
    gpt2 = TransformerConfig(vocab_size=50304, d_model=768, n_heads=12, n_encoder_layers=0,
                             n_decoder_layers=12, d_ff=3072, dropout=0.0, activation="gelu",
                             norm_first=True, max_len=8192)  # fmt: skip
    seq2seq = TransformerConfig(vocab_size=32000, d_model=512, n_heads=8, n_encoder_layers=6,
                                n_decoder_layers=6, d_ff=2048, dropout=0.0, max_len=8192)  # fmt: skip
    return [
        ModelCase("gpt2-small", gpt2, lengths, 16384, torch.bfloat16),
        ModelCase("seq2seq", seq2seq, lengths, 16384, torch.bfloat16),
    ]


def variants(model: Transformer, device: torch.device) -> dict[str, Transformer]:
    """naive, torch and (where fusedattn's Triton kernels run) fusedattn-triton."""
    out = {"naive": model, "torch": fusedattn.swap_modules(copy.deepcopy(model), backend="torch")}
    ops = ("attention", "layer_norm", "softmax")
    if all("triton" in harness.kernel_backends(op, device) for op in ops):
        out["fusedattn-triton"] = fusedattn.swap_modules(copy.deepcopy(model), backend="triton")
    return out


def batch(case: ModelCase, T: int, B: int, device):
    src = torch.randint(3, case.cfg.vocab_size, (B, T), device=device)
    return (src, src) if case.cfg.kind == "encoder-decoder" else (src, None)


def check(model, naive, case: ModelCase, device) -> str:
    src, tgt = batch(case, 128, 1, device)
    truth = copy.deepcopy(naive).double()
    with torch.no_grad():
        out = model(src, tgt) if tgt is not None else model(src)
        want = truth(src, tgt) if tgt is not None else truth(src)
        base = naive(src, tgt) if tgt is not None else naive(src)
    return harness.correctness(out, want, base, k=3.0)


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    rows = []
    for case in cases(quick, device):
        torch.manual_seed(0)
        naive = Transformer(case.cfg).to(device=device, dtype=case.dtype)
        for impl, model in variants(naive, device).items():
            verdict = check(model, naive, case, device)
            for T in case.lengths:
                B = max(1, case.tokens // T)
                src, tgt = batch(case, T, B, device)

                def infer(model=model, src=src, tgt=tgt):
                    with torch.no_grad():
                        return model(src, tgt) if tgt is not None else model(src)

                def train(model=model, src=src, tgt=tgt):
                    model.loss(src, tgt).backward()
                    model.zero_grad(set_to_none=True)

                for mode, fn in (("infer", infer), ("train", train)):
                    model.train(mode == "train")
                    fields = dict(op=f"model:{case.name}", mode=mode, impl=impl,
                                  dtype=str(case.dtype)[6:], B=B, H=case.cfg.n_heads, Tq=T,
                                  Tk=T, D=case.cfg.d_model)  # fmt: skip
                    try:
                        ms = harness.time_ms(fn, device=device, reps=3)
                        peak = harness.peak_memory_mb(fn, device=device)
                    except torch.cuda.OutOfMemoryError:
                        torch.cuda.empty_cache()
                        rows.append(harness.make_row(env, **fields, note="out of memory"))
                        print(f"  model {case.name} {mode} {impl} T={T}: out of memory")
                        continue
                    row = harness.make_row(env, **fields, ms=ms, peak_mem_mb=peak,
                                           tokens_per_s=B * T / (ms * 1e-3),
                                           **{"pass": verdict})  # fmt: skip
                    harness.progress(row)
                    rows.append(row)
        del naive
    harness.add_speedups(rows)
    return rows


if __name__ == "__main__":
    harness.cli(run, "model.csv")
