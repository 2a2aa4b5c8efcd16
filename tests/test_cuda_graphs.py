"""Decoding captured whole (issue #49 item 3): a decode step (append + attention) over caches
held as module buffers, and Hugging Face's static-cache generation, under
torch.compile(mode="reduce-overhead") — CUDA graphs replayed with updated inputs, equal to eager.
The GPU tests run on a GPU machine (scripts/gpu_check.sh step `graphs`); here the same steps run
compiled with the aot_eager backend, so the code path (ops, mutation, buffers) is checked on
every CPU run."""

import pytest
import torch

import fusedattn

HAS_CUDA = torch.cuda.is_available()


class DecodeStep(torch.nn.Module):
    """A decoder layer's attention step as a serving stack writes it: the caches are buffers
    (CUDA-graph trees skip capture when an op mutates a tensor that came from eager code)."""

    def __init__(self, B, S, Hq, Hkv, D, dtype, backend, paged):
        super().__init__()
        self.backend = backend
        if paged:
            page = 16
            pages = B * S // page
            self.register_buffer("k_cache", torch.zeros(pages + 1, page, Hkv, D, dtype=dtype))
            self.register_buffer("v_cache", torch.zeros(pages + 1, page, Hkv, D, dtype=dtype))
            table = torch.randperm(pages + 1)[:pages].view(B, -1).to(torch.int32)
            self.register_buffer("block_table", table)
        else:
            self.register_buffer("k_cache", torch.zeros(B, S, Hkv, D, dtype=dtype))
            self.register_buffer("v_cache", torch.zeros(B, S, Hkv, D, dtype=dtype))
            self.block_table = None

    def forward(self, q, k, v, lengths):
        return fusedattn.attention_with_kvcache(
            q, self.k_cache, self.v_cache, k, v, cache_seqlens=lengths,
            block_table=self.block_table, is_causal=True, backend=self.backend,
        )  # fmt: skip


def run_steps(mode: str, device: str, backend: str, paged: bool, steps: int = 4):
    """(outputs and final caches of `steps` compiled decode steps, the same eagerly)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, S, Hq, Hkv, D = 2, 64, 4, 2, 64
    args = (B, S, Hq, Hkv, D, dtype, backend, paged)
    compiled, eager = DecodeStep(*args).to(device), DecodeStep(*args).to(device)
    eager.load_state_dict(compiled.state_dict())
    if paged:
        eager.block_table = compiled.block_table
    step = torch.compile(compiled, mode=mode, fullgraph=True) if mode else torch.compile(
        compiled, backend="aot_eager", fullgraph=True
    )  # fmt: skip
    lengths = torch.tensor([5, 30], dtype=torch.int32, device=device)
    outs = []
    with torch.inference_mode():
        for _ in range(steps):  # new inputs each step, the lengths advancing
            q = torch.randn(B, 1, Hq, D, device=device, dtype=dtype)
            k, v = (torch.randn(B, 1, Hkv, D, device=device, dtype=dtype) for _ in range(2))
            got = step(q, k, v, lengths).clone()  # a graph's output is rewritten by its replay
            want = eager(q, k, v, lengths)
            outs.append((got, want))
            lengths = lengths + 1
    return outs, (compiled.k_cache, eager.k_cache), (compiled.v_cache, eager.v_cache)


def check(outs, k_caches, v_caches):
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(*k_caches) and torch.equal(*v_caches)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the reduce-overhead form below runs instead")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.kernels)])
def test_compiled_decode_steps_write_the_cache_buffers_as_eager(backend, paged):
    """The CPU form of the GPU test below: aot_eager, the same module and steps."""
    check(*run_steps(None, "cpu", backend, paged))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_reduce_overhead_replays_decode_steps_equal_to_eager(paged):
    """CUDA graphs through torch.compile(mode="reduce-overhead"): the Triton decode step with
    its append, replayed with new queries, keys and advancing lengths, equals eager bit for
    bit (the same kernels, the same split), the cache buffers written alike."""
    check(*run_steps("reduce-overhead", "cuda", "triton", paged))


def _static_generation(device: str, compile_config):
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("fusedattn.integrations.huggingface")
    import test_huggingface as models

    hf.register("fusedattn-triton", backend="triton")
    eager = models.eager_twin(models.llama_config()).to(device)
    ours = models.causal_lm(models.llama_config(), "fusedattn-triton", eager.state_dict())
    ours = ours.to(device)
    ids, mask = models.padded_batch(8)
    kw = dict(attention_mask=mask.to(device), max_new_tokens=6, do_sample=False,
              pad_token_id=0, cache_implementation="static")  # fmt: skip
    want = eager.generate(ids.to(device), **kw)
    config = transformers.CompileConfig(**compile_config)
    config._compile_all_devices = True
    got = ours.generate(ids.to(device), compile_config=config, **kw)
    assert torch.equal(got, want)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the reduce-overhead form below runs instead")
@pytest.mark.kernels
@pytest.mark.slow
def test_static_cache_generation_compiled_by_generate_cpu_form():
    torch._dynamo.reset()
    _static_generation("cpu", dict(fullgraph=True, backend="aot_eager"))


@pytest.mark.gpu
def test_static_cache_generation_under_reduce_overhead_equals_eager():
    """generate's own compile on CUDA (mode="reduce-overhead": CUDA graphs of each decode
    step), fusedattn's Triton decode kernel inside, eager's tokens."""
    torch._dynamo.reset()
    _static_generation("cuda", dict(fullgraph=True, mode="reduce-overhead"))
