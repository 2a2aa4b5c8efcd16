"""Model level: the reference transformer's training step and inference, tokens/s and peak
memory: naive modules vs torch's own fused ops (swap_modules(backend="torch"), what a user
has without fusedattn) vs fusedattn with backend="auto", "triton" and "cuda".

    python benchmarks/bench_model.py [--quick] [--out DIR]

GPU: a GPT-2-small-sized decoder (12 x 768, 12 heads, causal) and a BERT-base-sized encoder
(12 x 768, 12 heads) on padded batches (lengths uniform in [T/2, T], the padding masked as
keys), bf16, B*T = 16k tokens, T = 512 and 2048 (--quick; up to 8192 otherwise; full runs add
an encoder-decoder); a naive run that does not fit is recorded as "out of memory" (the
O(T^2) story). CPU: tiny decoder and padded-encoder models, to show the harness.
The pass column compares each impl's logits with the naive model in float64 (k = 3), once
per model and impl at T = 128 (with the case's padding).
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
    padded: bool = False  # lengths uniform in [T/2, T], the rest pad tokens


def cases(quick: bool, device: torch.device) -> list[ModelCase]:
    if device.type != "cuda":
        tiny = dict(vocab_size=1000, d_model=128, n_heads=4, d_ff=512, dropout=0.0, max_len=256)
        return [
            ModelCase("tiny-decoder", TransformerConfig(n_encoder_layers=0, n_decoder_layers=2,
                                                        **tiny), (64, 128), 512, torch.float32),
            ModelCase("tiny-encoder-padded", TransformerConfig(n_encoder_layers=2,
                                                               n_decoder_layers=0, **tiny),
                      (64,), 512, torch.float32, padded=True),
        ]  # fmt: skip
    lengths = (512, 2048) if quick else (512, 1024, 2048, 4096, 8192)
    gpt2 = TransformerConfig(vocab_size=50304, d_model=768, n_heads=12, n_encoder_layers=0,
                             n_decoder_layers=12, d_ff=3072, dropout=0.0, activation="gelu",
                             norm_first=True, max_len=8192)  # fmt: skip
    bert = TransformerConfig(vocab_size=30528, d_model=768, n_heads=12, n_encoder_layers=12,
                             n_decoder_layers=0, d_ff=3072, dropout=0.0, activation="gelu",
                             max_len=8192)  # fmt: skip
    seq2seq = TransformerConfig(vocab_size=32000, d_model=512, n_heads=8, n_encoder_layers=6,
                                n_decoder_layers=6, d_ff=2048, dropout=0.0, max_len=8192)  # fmt: skip
    out = [
        ModelCase("gpt2-small", gpt2, lengths, 16384, torch.bfloat16),
        ModelCase("bert-base-padded", bert, lengths, 16384, torch.bfloat16, padded=True),
    ]
    if not quick:
        out.append(ModelCase("seq2seq", seq2seq, lengths, 16384, torch.bfloat16))
    return out


def variants(model: Transformer, device: torch.device) -> dict[str, Transformer]:
    """naive; torch (what a user has); fusedattn with auto and each kernel backend that runs
    the model's ops here."""
    swap = lambda backend: fusedattn.swap_modules(copy.deepcopy(model), backend=backend)  # noqa: E731
    out = {"naive": model, "torch": swap("torch"), "auto": swap("auto")}
    for backend in harness.KERNEL_BACKENDS:
        if all(
            backend in harness.kernel_backends(op, device) for op in ("attention", "layer_norm")
        ):
            out[f"fusedattn-{backend}"] = swap(backend)
    return out


def batch(case: ModelCase, T: int, B: int, device):
    """(src, tgt) token ids; padded cases end each sequence with pad tokens after a length
    uniform in [T/2, T] (and label every real token, masked-LM style)."""
    cfg = case.cfg
    src = torch.randint(3, cfg.vocab_size, (B, T), device=device)
    if case.padded:
        lengths = torch.randint(T // 2, T + 1, (B, 1), device=device)
        src = src.masked_fill(torch.arange(T, device=device) >= lengths, cfg.pad_id)
    if cfg.kind == "encoder-decoder":
        return src, src
    return (src, src) if cfg.kind == "encoder-only" else (src, None)


def forward(model, case: ModelCase, src, tgt):
    return model(src, tgt) if case.cfg.kind == "encoder-decoder" else model(src)


def check(model, naive, case: ModelCase, device) -> str:
    src, tgt = batch(case, 128, 2, device)
    truth = copy.deepcopy(naive).double()
    with torch.no_grad():
        out, want, base = (forward(m, case, src, tgt) for m in (model, truth, naive))
    if case.padded:  # positions of pad tokens are not outputs anyone reads
        real = (src != case.cfg.pad_id)[..., None]
        out, want, base = (t * real for t in (out, want, base))
    return harness.correctness(out, want, base, k=3.0)


COMPILED = ("torch", "auto")  # inference also timed compiled: what serving users run


def compiled_infer(model, case, src, tgt, device):
    """The inference forward under torch.compile(fullgraph=True): mode="reduce-overhead" (CUDA
    graphs) on a GPU, dynamo's eager backend on a CPU (a smoke form: the trace, no speed
    meaning); None, said, when it does not compile."""
    options = dict(mode="reduce-overhead") if device.type == "cuda" else dict(backend="eager")
    torch._dynamo.reset()
    model.eval()
    step = torch.compile(lambda src, tgt: forward(model, case, src, tgt), fullgraph=True, **options)

    def infer():
        with torch.no_grad():
            return step(src, tgt)

    try:
        infer()
    except Exception as exc:  # a benchmark reports what it could not run, it does not stop
        print(
            f"  model {case.name} infer-compiled: not compiled ({type(exc).__name__}: {exc})"[:300]
        )
        return None
    return infer


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

                def infer(model=model, src=src, tgt=tgt, case=case):
                    with torch.no_grad():
                        return forward(model, case, src, tgt)

                def train(model=model, src=src, tgt=tgt):
                    model.loss(src, tgt).backward()
                    model.zero_grad(set_to_none=True)

                modes = [("infer", infer), ("train", train)]
                if impl in COMPILED:
                    modes.append(("infer-compiled", compiled_infer(model, case, src, tgt, device)))
                for mode, fn in modes:
                    model.train(mode == "train")
                    if fn is None:  # the compile failed: said once, no row
                        continue
                    fields = dict(op=f"model:{case.name}", mode=mode, impl=impl,
                                  dtype=str(case.dtype)[6:], B=B, H=case.cfg.n_heads, Tq=T,
                                  Tk=T, D=case.cfg.d_model)  # fmt: skip
                    try:
                        ms, spread = harness.time_stats(fn, device=device, reps=3)
                        peak = harness.peak_memory_mb(fn, device=device)
                    except torch.cuda.OutOfMemoryError:
                        torch.cuda.empty_cache()
                        rows.append(harness.make_row(env, **fields, note="out of memory"))
                        harness.stream(rows[-1])
                        print(f"  model {case.name} {mode} {impl} T={T}: out of memory")
                        continue
                    row = harness.make_row(env, **fields, ms=ms, peak_mem_mb=peak,
                                           tokens_per_s=B * T / (ms * 1e-3), spread=spread,
                                           note=harness.noisy(spread).lstrip("; ") or None,
                                           **{"pass": verdict})  # fmt: skip
                    harness.progress(row)
                    rows.append(row)
        del naive
    harness.add_speedups(rows)
    return rows


if __name__ == "__main__":
    harness.cli(run, "model.csv")
