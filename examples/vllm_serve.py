"""Serve a model with vLLM on fusedattn's paged attention kernels.

    python examples/vllm_serve.py                 # a small random Llama, vLLM's CPU build
    python examples/vllm_serve.py --model DIR     # any local Hugging Face model folder

Installing fusedattn next to vLLM installs its plugin, which does nothing until asked: on a
GPU ask with vLLM's own switch, `attention_backend="CUSTOM"` (`--attention-backend CUSTOM` on
the command line); vLLM's CPU platform always takes its own attention, so there the switch is
FUSEDATTN_VLLM=1 in the environment (set below). docs/vllm.md has what is served and what is
refused.
"""

import argparse
import os
import tempfile

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a local model folder (default: a random one)"
    )
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("FUSEDATTN_VLLM", "1")  # before vLLM starts: its plugins read it
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU

    from vllm import LLM, SamplingParams  # after the environment is set

    model = args.model or random_llama()
    # On the CPU: fp32, and eager (vLLM's inductor compile of the model takes ~90 s there)
    engine = (dict(attention_backend="CUSTOM") if on_gpu
              else dict(dtype="float32", enforce_eager=True))  # fmt: skip
    llm = LLM(model=model, skip_tokenizer_init=args.model is None, max_model_len=512, **engine)
    prompts = [{"prompt_token_ids": list(range(1, n))} for n in (5, 40, 90)]
    params = SamplingParams(max_tokens=16, temperature=0.0, detokenize=args.model is not None)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        print(f"request: {len(prompt['prompt_token_ids'])} prompt tokens ->",
              out.outputs[0].token_ids)  # fmt: skip
    # vLLM's log has said which attention served: "fusedattn's vLLM backend serves ..." (INFO)


def random_llama() -> str:
    """A folder holding a small random Llama: 2 layers, 4 query heads over 2 KV heads of 64."""
    import transformers

    folder = tempfile.mkdtemp()
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
