"""The same prompt alone and inside a changing batch, with fusedattn.batch_invariant on: the
same tokens, and what of the log-probabilities holds bit for bit.

    python examples/batch_invariant.py                  # Hugging Face generate (a tiny Llama)
    python examples/batch_invariant.py --engine vllm    # vLLM's CPU build (its own venv)

Both run fusedattn's Triton kernels (in the interpreter on a CPU): under the switch every
attention call of a step, prefill and decode alike, is the decode kernel with its key splits at
fixed positions from each sequence's first key.

- vLLM: greedy tokens and their log-probabilities equal bit for bit, alone and in two other
  batches; with the switch off the log-probabilities differ in their last bits.
- Hugging Face: greedy tokens and their log-probabilities equal bit for bit alone and
  left-padded in two other batches. Besides the attention (attn_implementation="fusedattn"),
  `fusedattn.swap_modules(model, linear=True)` puts fusedattn's RMSNorm and Linear in the
  model: under the switch its projections and its head run the batch-invariant Triton matmul
  (torch's own matmuls take another path for one row than for several, and a decode step
  multiplies B rows). With the switch off the log-probabilities differ in their last bits.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on a CPU
import torch
import transformers

import fusedattn

VOCAB = 512


def tiny_llama(attn_implementation=None):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        pad_token_id=0,
    )  # fmt: skip
    kw = {} if attn_implementation is None else dict(attn_implementation=attn_implementation)
    model = transformers.AutoModelForCausalLM.from_config(cfg, **kw).eval()
    with torch.no_grad():  # weights larger than the init's: logits far from uniform
        for p in model.parameters():
            p.mul_(3.0)
    return model


def prompts():
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, VOCAB, (37,), generator=g)
    others = [torch.randint(1, VOCAB, (n,), generator=g) for n in (5, 30, 13)]
    # the prompt alone, then inside two batches of other prompts, at other places
    return prompt, [([prompt], 0), ([others[0], prompt, others[1]], 1), ([prompt, others[2]], 0)]


def hf() -> None:
    import fusedattn.integrations.huggingface as fa_hf

    fa_hf.register()
    model = fusedattn.swap_modules(tiny_llama("fusedattn"), linear=True)
    prompt, batches = prompts()

    def left_padded(seqs):
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, T - len(s) :], mask[i, T - len(s) :] = s, 1
        return ids, mask

    caught = []
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: caught.append(a[0]))

    def generate(seqs, at):
        ids, mask = left_padded(seqs)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)  # fmt: skip
        logprobs = torch.stack([torch.log_softmax(x[at].float(), -1) for x in out.logits])
        return out.sequences[at, ids.shape[1] :].tolist(), logprobs

    runs = [generate(seqs, at) for seqs, at in batches]
    tokens = [t for t, _ in runs]
    assert all(t == tokens[0] for t in tokens), tokens
    same_logprobs = all(torch.equal(lp, runs[0][1]) for _, lp in runs)
    assert same_logprobs, "a log-probability changed with the batch"
    with fusedattn.batch_invariant(False):
        off = [generate(seqs, at)[1] for seqs, at in batches]
    off_gap = max((lp - off[0]).abs().max().item() for lp in off)

    attention = []
    for seqs, at in batches:
        ids, mask = left_padded(seqs)
        caught.clear()
        with torch.no_grad():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
        attention.append([c[at, -len(prompt) :] for c in caught])
    same = all(
        torch.equal(a, b)
        for layer in attention[1:]
        for a, b in zip(attention[0], layer, strict=True)
    )
    assert same, "an attention output changed with the batch"
    print(f"hf: tokens {tokens[0]} and their log-probabilities equal bit for bit in all "
          f"{len(batches)} batches, each layer's attention output too; with the switch off the "
          f"log-probabilities differ by up to {off_gap:.1e}")  # fmt: skip


def vllm() -> None:
    os.environ.update(FUSEDATTN_VLLM="1", FUSEDATTN_VLLM_BACKEND="triton",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")  # fmt: skip
    from vllm import LLM, SamplingParams

    folder = tempfile.mkdtemp()
    tiny_llama().save_pretrained(folder)
    llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=512, block_size=32, seed=0)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, detokenize=False,
                            ignore_eos=True)  # fmt: skip
    _, batches = prompts()

    def run():
        results = []
        for seqs, at in batches:
            batch = [{"prompt_token_ids": s.tolist()} for s in seqs]
            out = llm.generate(batch, params, use_tqdm=False)[at].outputs[0]
            logprobs = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
            results.append((list(out.token_ids), logprobs))
        return results

    on = run()
    assert all(r == on[0] for r in on), "tokens or log-probabilities changed with the batch"
    with fusedattn.batch_invariant(False):
        off = run()
    print(f"vllm: tokens {on[0][0]} and their log-probabilities equal bit for bit in all "
          f"{len(batches)} batches; with the switch off the log-probabilities "
          f"{'also agree' if all(r == off[0] for r in off) else 'differ'}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    args = parser.parse_args()
    fusedattn.batch_invariant(True)
    hf() if args.engine == "hf" else vllm()
