"""Training demo: the reference seq2seq transformer learns to reverse digit strings, once with
its naive modules and once swapped to fusedattn's (same initial weights, same batches). The
two loss curves should lie on top of each other; greedy and beam-search accuracy on 200
held-out strings are reported for both.

    python benchmarks/bench_demo.py [--out DIR]

Rows: mode "train" (one per step: step, loss, ms) and modes "greedy" / "beam" (accuracy in
note). Writes demo.png with the two curves. ~25 s per run on 2 CPU cores.
"""

from __future__ import annotations

import copy
import time

import harness
import torch

import fusedattn
from fusedattn.reference import tasks
from fusedattn.reference.transformer import Transformer, TransformerConfig

STEPS = 700


def fused_backend(device: torch.device) -> str:
    """fusedattn's kernels where they run, else the backend auto picks (torch on CPU)."""
    ops = ("attention", "layer_norm", "softmax")
    return (
        "triton" if all("triton" in harness.kernel_backends(op, device) for op in ops) else "auto"
    )


def train_pair(device: torch.device, env: dict, steps: int = STEPS) -> list[dict]:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=tasks.VOCAB, d_model=64, n_heads=4, n_encoder_layers=2,
                            n_decoder_layers=2, d_ff=128, dropout=0.0, max_len=32)  # fmt: skip
    naive = Transformer(cfg).to(device)
    backend = fused_backend(device)
    models = {"naive": naive, f"fused-{backend}": fusedattn.swap_modules(copy.deepcopy(naive),
                                                                       backend=backend)}  # fmt: skip
    src, tgt = tasks.reversal_batch(200, generator=torch.Generator().manual_seed(123),
                                    device=device)  # fmt: skip
    rows = []
    for impl, model in models.items():
        start = time.perf_counter()
        losses = tasks.train_reversal(model, steps=steps)
        ms = (time.perf_counter() - start) * 1e3 / steps
        common = dict(op="demo:reversal", impl=impl, dtype="float32", D=cfg.d_model,
                      H=cfg.n_heads)  # fmt: skip
        rows += [
            harness.make_row(env, mode="train", step=i, loss=loss, ms=ms, **common)
            for i, loss in enumerate(losses)
        ]
        model.eval()
        greedy = model.greedy_decode(src, 10, bos_id=tasks.BOS, eos_id=tasks.EOS)
        beam = model.beam_search(src, 10, beam_size=3, bos_id=tasks.BOS, eos_id=tasks.EOS)
        for mode, out in (("greedy", greedy), ("beam", beam)):
            accuracy = tasks.exact_match(out, tgt)
            rows.append(harness.make_row(env, mode=mode, note=f"accuracy={accuracy:.3f}", **common))
        final = sum(losses[-20:]) / 20
        print(f"  demo {impl}: final loss {final:.4f}, {ms:.1f} ms/step, "
              f"{rows[-2]['note']} (greedy), {rows[-1]['note']} (beam)")  # fmt: skip
    return rows


def plot(rows: list[dict], path) -> object:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in sorted({r["impl"] for r in rows}):
        curve = [(int(r["step"]), float(r["loss"])) for r in rows
                 if r["impl"] == impl and r["mode"] == "train"]  # fmt: skip
        ax.plot([c[0] for c in curve], [c[1] for c in curve], label=impl, alpha=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("teacher-forced loss")
    ax.set_title("reversal: naive vs fused modules")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    return train_pair(device, env)


if __name__ == "__main__":
    harness.cli(run, "demo.csv")
