"""swap_modules inside torch's transformer layers and the reference transformer: every module
replaced, fusedattn's kernels really running (torch's fast paths do not bypass them, in train
and in eval), outputs and gradients within the k× rule for models, autocast, torch.compile."""

import copy
import os

import pytest
import torch
from dispatch_probe import count_dispatches
from torch import nn

import fusedattn
from fusedattn.reference import modules as naive
from fusedattn.reference.transformer import Transformer, TransformerConfig
from fusedattn.testing import assert_close_kx

MODEL_K = 3.0  # the k of the rule for whole models
# The Triton kernels on CPU tensors run in the interpreter (conftest sets it without a GPU).
TRITON_ON_CPU = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
    ),
)
CPU_BACKENDS = ["reference", "torch", TRITON_ON_CPU]


def encoder_layer(batch_first, norm_first=False):
    return nn.TransformerEncoderLayer(
        32, 4, dim_feedforward=64, dropout=0.0, batch_first=batch_first, norm_first=norm_first
    )


def all_kinds(model):
    return {type(m) for m in model.modules()}


def test_swap_replaces_every_module_with_weights_mode_and_dtype():
    model = (
        nn.Sequential(encoder_layer(True), nn.LayerNorm(32), nn.Softmax(-1))
        .to(torch.float64)
        .eval()
    )
    swapped = fusedattn.swap_modules(copy.deepcopy(model), backend="torch")
    kinds = all_kinds(swapped)
    assert nn.MultiheadAttention not in kinds
    assert {fusedattn.MultiheadAttention, fusedattn.LayerNorm, fusedattn.Softmax} <= kinds
    assert not any(m.training for m in swapped.modules())
    assert swapped.state_dict().keys() == model.state_dict().keys()
    for (name, a), (_, b) in zip(
        swapped.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b) and a.dtype == torch.float64, name
    only_norms = fusedattn.swap_modules(copy.deepcopy(model), attention=False, softmax=False)
    assert nn.MultiheadAttention in all_kinds(only_norms) and nn.Softmax in all_kinds(only_norms)
    assert isinstance(fusedattn.swap_modules(nn.LayerNorm(4)), fusedattn.LayerNorm)
    again = fusedattn.swap_modules(swapped, backend="reference", layernorm=False)
    assert again is swapped
    assert {m.backend for m in again.modules() if isinstance(m, fusedattn.MultiheadAttention)} == {
        "reference"
    }
    assert {m.backend for m in again.modules() if isinstance(m, fusedattn.LayerNorm)} == {"torch"}


def test_swap_modules_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, got list"):
        fusedattn.swap_modules([nn.LayerNorm(4)])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_eval_fast_path_never_bypasses_swapped_norms():
    """Swapping only the norms (attention=False): torch's encoder fast path and nested-tensor
    path must stay off in eval, or the swapped LayerNorms never run."""
    layer = encoder_layer(batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    swapped = fusedattn.swap_modules(copy.deepcopy(model), backend="reference", attention=False)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), count_dispatches() as counts:
        out = swapped(x, src_key_padding_mask=kpm)
    assert counts == {("layer_norm", "reference"): 4}
    assert not out.is_nested
    with torch.no_grad():
        torch.testing.assert_close(out[0], model(x, src_key_padding_mask=kpm)[0])


def run_and_compare(model, make_inputs, *, backend="torch", train=True, expect=()):
    """Original model in float64 (truth) and float32 (baseline) vs the swapped float32 model:
    outputs and parameter gradients under the k× rule; returns the dispatch counts."""
    model = model.train(train)
    truth = copy.deepcopy(model).double()
    swapped = fusedattn.swap_modules(copy.deepcopy(model), backend=backend)
    args = make_inputs()
    out_base = model(*args)
    out_truth = truth(*[a.double() if a is not None and a.is_floating_point() else a for a in args])
    with count_dispatches() as counts:
        out = swapped(*args)
        if train:
            out.square().sum().backward()
    assert_close_kx(out, out_truth, out_base, k=MODEL_K)
    if train:
        out_base.square().sum().backward()
        out_truth.square().sum().backward()
        params = zip(
            swapped.named_parameters(), model.parameters(), truth.parameters(), strict=True
        )
        for (name, p), pb, pt in params:
            assert_close_kx(p.grad, pt.grad, pb.grad, k=MODEL_K, name=name)
    for op in expect:
        assert counts[(op, backend)] > 0, f"{op} did not run on {backend}: {dict(counts)}"
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_stack_runs_our_kernels(train, batch_first, norm_first, backend):
    layer = encoder_layer(batch_first, norm_first)
    # enable_nested_tensor=True is torch's default: swap_modules must turn that path off.
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=not norm_first)
    B, T = 3, 9
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, 6:] = True

    def make_inputs():
        x = torch.randn(B, T, 32) if batch_first else torch.randn(T, B, 32)
        return x, None, kpm

    def forward(m, x, mask, kpm):
        return m(x, mask=mask, src_key_padding_mask=kpm)

    wrapper = _Call(model, forward)
    counts = run_and_compare(
        wrapper, make_inputs, backend=backend, train=train, expect=("attention", "layer_norm")
    )
    assert counts[("attention", backend)] == 2


class _Call(nn.Module):
    """Wrap a model with a forward function so run_and_compare can call it positionally."""

    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args):
        return self.fn(self.model, *args)


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_nn_transformer_with_padding_and_causal_masks(train, batch_first, backend):
    model = nn.Transformer(32, 4, num_encoder_layers=2, num_decoder_layers=2,
                           dim_feedforward=64, dropout=0.0, batch_first=batch_first)  # fmt: skip
    B, S, T = 2, 7, 6
    src_kpm = torch.zeros(B, S, dtype=torch.bool)
    src_kpm[0, 5:] = True
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(T)

    def make_inputs():
        shape = (lambda L: (B, L, 32)) if batch_first else (lambda L: (L, B, 32))
        return torch.randn(shape(S)), torch.randn(shape(T))

    def forward(m, src, tgt):
        return m(src, tgt, tgt_mask=tgt_mask.to(src.dtype), src_key_padding_mask=src_kpm,
                 memory_key_padding_mask=src_kpm, tgt_is_causal=True)  # fmt: skip

    counts = run_and_compare(_Call(model, forward), make_inputs, backend=backend, train=train,
                             expect=("attention", "layer_norm"))  # fmt: skip
    # 2 encoder self-attentions + 2 x (decoder self + cross) attentions
    assert counts[("attention", backend)] == 6


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_reference_transformer_swapped(backend, train, norm_first):
    cfg = TransformerConfig(vocab_size=20, d_model=32, n_heads=4, d_ff=64, dropout=0.0,
                            norm_first=norm_first)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    src = torch.randint(3, 20, (2, 8))
    src[1, 6:] = cfg.pad_id
    tgt = torch.randint(3, 20, (2, 5))

    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, src, tgt):
            return self.m(src, tgt)

    run_and_compare(Logits(model), lambda: (src, tgt), backend=backend, train=train,
                    expect=("attention", "layer_norm"))  # fmt: skip
    swapped = fusedattn.swap_modules(copy.deepcopy(model))
    assert not any(type(m).__module__ == "fusedattn.reference.modules" for m in swapped.modules())


def test_only_softmax_swapped_in_the_naive_attention():
    model = Transformer(TransformerConfig(vocab_size=20, d_model=32, n_heads=4, dropout=0.0))
    swapped = fusedattn.swap_modules(copy.deepcopy(model), attention=False, layernorm=False,
                                     backend="torch")  # fmt: skip
    src, tgt = torch.randint(3, 20, (2, 8)), torch.randint(3, 20, (2, 5))
    with count_dispatches() as counts:
        out = swapped(src, tgt)
    # The naive attention's softmax now runs on torch; LayerNorm stays the naive module (it
    # computes with fusedattn.reference.layer_norm directly: no dispatch).
    assert set(counts) == {("softmax", "torch")}
    kinds = {type(m) for m in swapped.modules()}
    assert naive.LayerNorm in kinds and naive.MultiheadAttention in kinds
    torch.testing.assert_close(out, model(src, tgt))


@pytest.mark.parametrize("device_type,dtype", [("cpu", torch.bfloat16), ("cpu", torch.float16)])
def test_autocast_gives_what_the_torch_modules_give(device_type, dtype):
    torch.manual_seed(0)
    model = nn.TransformerEncoder(encoder_layer(True), 2, enable_nested_tensor=False).train()
    truth = copy.deepcopy(model).double()
    swapped = fusedattn.swap_modules(copy.deepcopy(model), backend="torch")
    x = torch.randn(2, 9, 32)
    with torch.autocast(device_type, dtype=dtype):
        base, out = model(x), swapped(x)
    assert out.dtype == base.dtype
    assert_close_kx(out, truth(x.double()), base, k=MODEL_K)
    with torch.autocast(device_type, dtype=dtype):
        ln, ln_t = fusedattn.LayerNorm(32), nn.LayerNorm(32)
        assert ln(x).dtype == ln_t(x).dtype and ln(x.to(dtype)).dtype == ln_t(x.to(dtype)).dtype
        sm = fusedattn.Softmax(-1)
        assert sm(x.to(dtype)).dtype == nn.Softmax(-1)(x.to(dtype)).dtype


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_policies(dtype):
    x = torch.randn(4, 32, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        for ours, theirs in ((fusedattn.LayerNorm(32).cuda(), nn.LayerNorm(32).cuda()),
                             (fusedattn.Softmax(-1), nn.Softmax(-1))):  # fmt: skip
            assert ours(x.to(dtype)).dtype == theirs(x.to(dtype)).dtype
        q = torch.randn(1, 2, 8, 16, device="cuda")
        assert fusedattn.attention(q, q, q).dtype == dtype


@pytest.mark.parametrize(
    "compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
def test_torch_compile_fullgraph_of_a_swapped_model(compiler):
    torch._dynamo.reset()
    model = nn.TransformerEncoder(encoder_layer(True), 2, enable_nested_tensor=False).eval()
    swapped = fusedattn.swap_modules(copy.deepcopy(model), backend="torch")
    compiled = torch.compile(swapped, fullgraph=True, backend=compiler)
    x = torch.randn(2, 9, 32)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 7:] = True
    torch.testing.assert_close(compiled(x, src_key_padding_mask=kpm),
                               swapped(x, src_key_padding_mask=kpm))  # fmt: skip
    swapped.train()
    compiled = torch.compile(swapped, fullgraph=True, backend=compiler)
    compiled(x).sum().backward()
    assert all(p.grad is not None for p in swapped.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swapped_nn_transformer_on_cuda_in_half_precision(dtype):
    torch.manual_seed(0)
    model = nn.Transformer(256, 8, num_encoder_layers=2, num_decoder_layers=2,
                           dim_feedforward=512, dropout=0.0, batch_first=True).cuda()  # fmt: skip
    truth = copy.deepcopy(model).double()
    base = copy.deepcopy(model).to(dtype)
    swapped = fusedattn.swap_modules(copy.deepcopy(model).to(dtype))
    src, tgt = torch.randn(4, 300, 256, device="cuda"), torch.randn(4, 200, 256, device="cuda")
    kpm = torch.zeros(4, 300, dtype=torch.bool, device="cuda")
    kpm[1, 250:] = True
    mask = nn.Transformer.generate_square_subsequent_mask(200, device="cuda")
    kw = dict(src_key_padding_mask=kpm, memory_key_padding_mask=kpm, tgt_is_causal=True)
    with count_dispatches() as counts:
        out = swapped(src.to(dtype), tgt.to(dtype), tgt_mask=mask.to(dtype), **kw)
    assert sum(n for (op, _), n in counts.items() if op == "attention") == 6
    want = truth(src.double(), tgt.double(), tgt_mask=mask.double(), **kw)
    assert_close_kx(out, want, base(src.to(dtype), tgt.to(dtype), tgt_mask=mask.to(dtype), **kw),
                    k=MODEL_K)  # fmt: skip
