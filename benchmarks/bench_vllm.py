"""vLLM serving throughput on fusedattn's attention against vLLM's default backend (issue #62).

    python benchmarks/bench_vllm.py [--quick] [--out DIR]      (in an environment with vLLM)

Each backend serves in its own process (an engine holds most of the GPU's memory): vLLM's
default (`vllm-default`: whatever vLLM's platform picks, FLASH_ATTN on an H100/H200) and
fusedattn's plugin (`fusedattn`: `attention_backend="CUSTOM"` on a GPU, FUSEDATTN_VLLM=1 on the
CPU). A random Llama saved to a temporary folder (GPU: 8 layers of Llama-3-8B's attention,
32 query heads over 8 KV heads of 128, bf16; CPU: the tests' small one in fp32) serves a batch
of B prompts of `Tq` random tokens, `Tk` new tokens each, greedy, ignoring EOS: one warm-up
generate, then the timed one. B = 1, 4, 16, 64 (CPU: 1 and 4).

Rows (vllm.csv): op "vllm:<model>", mode "generate", tokens_per_s = generated tokens / wall
time of the generate call (prefill included), ms the call's wall time; `pass` on fusedattn's
rows: "yes" where every request's greedy tokens equal vLLM's default backend's, else the
share of requests that agree (bf16 on a GPU: two correct kernels may round a near-tie
differently, so the share is the measure, not a hard gate); note: the speedup over vLLM's row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import harness
import torch

BATCHES_GPU = (1, 4, 16, 64)
BATCHES_CPU = (1, 4)
MARK = "bench_vllm results: "  # the serving process's answer, among vLLM's log lines


def model_config(on_gpu: bool) -> dict:
    if on_gpu:  # Llama-3-8B's attention shape, 8 layers, a 32k vocabulary
        return dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=8192)  # fmt: skip
    return dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=1024)  # fmt: skip


def save_model(folder: str, on_gpu: bool) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**model_config(on_gpu))
    dtype = torch.bfloat16 if on_gpu else torch.float32
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder)


def serve(folder: str, backend: str, batches, Tq: int, Tk: int) -> list[dict]:
    """In this process: one engine on `backend`, one timed generate per batch size."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, not a share of the memory
        if backend == "fusedattn":
            os.environ["FUSEDATTN_VLLM"] = "1"
    from vllm import LLM, SamplingParams

    engine = dict(dtype="bfloat16") if on_gpu else dict(dtype="float32", enforce_eager=True)
    if backend == "fusedattn" and on_gpu:
        engine["attention_backend"] = "CUSTOM"
    llm = LLM(model=folder, skip_tokenizer_init=True, max_model_len=Tq + Tk + 16, seed=0,
              **engine)  # fmt: skip
    params = SamplingParams(max_tokens=Tk, temperature=0.0, ignore_eos=True, detokenize=False)
    vocab = model_config(on_gpu)["vocab_size"]
    results = []
    for B in batches:
        g = torch.Generator().manual_seed(B)
        prompts = [{"prompt_token_ids": torch.randint(1, vocab, (Tq,), generator=g).tolist()}
                   for _ in range(B)]  # fmt: skip
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: graphs, compiled kernels
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        results.append(dict(B=B, seconds=seconds,
                            tokens=[list(o.outputs[0].token_ids) for o in outputs]))  # fmt: skip
    return results


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    on_gpu = device.type == "cuda"
    batches = BATCHES_GPU if on_gpu else BATCHES_CPU
    Tq, Tk = (1024, 128) if on_gpu else (64, 8)
    if quick and on_gpu:
        batches, Tk = (1, 16, 64), 64
    with tempfile.TemporaryDirectory() as folder:
        save_model(folder, on_gpu)
        served = {}
        for backend in ("vllm-default", "fusedattn"):
            # its own process: an engine keeps its memory (and its plugins' choice) until exit
            result = subprocess.run(
                [sys.executable, __file__, "--serve", folder, backend, json.dumps(batches),
                 str(Tq), str(Tk)],
                capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            if result.returncode != 0:
                print(f"  vllm {backend}: failed\n{result.stderr[-3000:]}")
                continue
            line = next(x for x in result.stdout.splitlines() if x.startswith(MARK))
            served[backend] = json.loads(line[len(MARK) :])
    rows = []
    dtype = "bfloat16" if on_gpu else "float32"
    cfg = model_config(on_gpu)
    for backend, results in served.items():
        for r in results:
            ms = r["seconds"] * 1e3
            row = dict(op="vllm:llama", mode="generate", impl=backend, dtype=dtype, B=r["B"],
                       H=cfg["num_attention_heads"], Tq=Tq, Tk=Tk, D=cfg["head_dim"],
                       causal=True, mask="paged", ms=ms,
                       tokens_per_s=r["B"] * Tk / r["seconds"])  # fmt: skip
            base = next((b for b in served.get("vllm-default", []) if b["B"] == r["B"]), None)
            if backend == "fusedattn" and base is not None:
                agree = sum(a == b for a, b in zip(r["tokens"], base["tokens"], strict=True))
                row["pass"] = "yes" if agree == r["B"] else f"{agree}/{r['B']} requests agree"
                row["note"] = f"{base['seconds'] / r['seconds']:.2f}x vLLM's default backend"
            rows.append(harness.make_row(env, **row))
            harness.progress(rows[-1])
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        folder, backend, batches, Tq, Tk = sys.argv[2:7]
        results = serve(folder, backend, json.loads(batches), int(Tq), int(Tk))
        print(MARK + json.dumps(results))
    else:
        harness.cli(run, "vllm.csv")
