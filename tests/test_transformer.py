"""The reference transformer: shapes of the three configurations, masks that really mask,
decoding, and a seq2seq model that learns to reverse digit strings on CPU."""

import math
import time

import pytest
import torch

from fusedattn.reference import tasks
from fusedattn.reference.transformer import Transformer, TransformerConfig

PAD, EOS, VOCAB = tasks.PAD, tasks.EOS, tasks.VOCAB


def small_config(**overrides):
    base = dict(vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, dropout=0.0, max_len=64)
    return TransformerConfig(**base | overrides)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize(
    "layers,kind",
    [((2, 2), "encoder-decoder"), ((2, 0), "encoder-only"), ((0, 2), "decoder-only")],
)
def test_configurations_run_forward_loss_and_backward(layers, kind, norm_first, activation):
    cfg = small_config(
        n_encoder_layers=layers[0],
        n_decoder_layers=layers[1],
        norm_first=norm_first,
        activation=activation,
    )
    assert cfg.kind == kind
    model = Transformer(cfg)
    src = torch.randint(3, VOCAB, (2, 9))
    tgt = torch.randint(3, VOCAB, (2, 6))
    if kind == "encoder-decoder":
        assert model(src, tgt).shape == (2, 6, VOCAB)
        loss = model.loss(src, tgt)
    elif kind == "encoder-only":
        assert model(src).shape == (2, 9, VOCAB)
        loss = model.loss(src, src)
    else:
        assert model(src).shape == (2, 9, VOCAB)
        loss = model.loss(src)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters())


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="needs encoder or decoder layers"):
        TransformerConfig(vocab_size=5, n_encoder_layers=0, n_decoder_layers=0)
    with pytest.raises(ValueError, match="activation"):
        TransformerConfig(vocab_size=5, activation="swish")


@pytest.mark.parametrize("norm_first", [False, True])
def test_padding_does_not_change_real_positions(norm_first):
    model = Transformer(small_config(norm_first=norm_first)).eval()
    src = torch.randint(3, VOCAB, (1, 5))
    tgt = torch.randint(3, VOCAB, (1, 4))
    padded_src = torch.cat([src, torch.full((1, 3), PAD)], dim=1)
    padded_tgt = torch.cat([tgt, torch.full((1, 2), PAD)], dim=1)
    torch.testing.assert_close(model(padded_src, padded_tgt)[:, :4], model(src, tgt))


def test_decoder_positions_do_not_see_the_future():
    model = Transformer(small_config(n_encoder_layers=0)).eval()
    tokens = torch.randint(3, VOCAB, (2, 8))
    changed = tokens.clone()
    changed[:, 5:] = torch.randint(3, VOCAB, (2, 3))
    torch.testing.assert_close(model(tokens)[:, :5], model(changed)[:, :5])
    assert not torch.allclose(model(tokens)[:, 5:], model(changed)[:, 5:])


def test_beam_of_one_is_greedy_and_decoding_stops_at_eos():
    model = Transformer(small_config()).eval()
    src = torch.randint(3, VOCAB, (4, 6))
    greedy = model.greedy_decode(src, 7)
    assert torch.equal(model.beam_search(src, 7, beam_size=1), greedy)
    for row in model.greedy_decode(src, 7).tolist():
        if EOS in row:
            assert all(t == PAD for t in row[row.index(EOS) + 1 :])
    lm = Transformer(small_config(n_encoder_layers=0)).eval()
    prompt = torch.randint(3, VOCAB, (2, 3))
    assert lm.greedy_decode(prompt, 4).shape[0] == 2
    assert lm.beam_search(prompt, 4, beam_size=3).shape[0] == 2


@pytest.mark.slow
def test_seq2seq_learns_to_reverse_digits_on_cpu():
    torch.manual_seed(0)
    model = Transformer(
        TransformerConfig(
            vocab_size=tasks.VOCAB, d_model=64, n_heads=4, n_encoder_layers=2,
            n_decoder_layers=2, d_ff=128, dropout=0.0, max_len=32,
        )
    )  # fmt: skip
    start = time.perf_counter()
    losses = tasks.train_reversal(model, steps=400)
    seconds = time.perf_counter() - start
    final = sum(losses[-20:]) / 20
    assert final < 0.01, f"final loss {final:.4f} (first {losses[0]:.2f}) after {seconds:.0f}s"
    model.eval()
    src, tgt = tasks.reversal_batch(200, generator=torch.Generator().manual_seed(123))
    bos, eos = tasks.BOS, EOS
    greedy = tasks.exact_match(model.greedy_decode(src, 10, bos_id=bos, eos_id=eos), tgt)
    beam = tasks.exact_match(model.beam_search(src, 10, beam_size=3, bos_id=bos, eos_id=eos), tgt)
    print(f"reversal: loss {final:.4f}, greedy {greedy:.1%}, beam {beam:.1%}, {seconds:.1f}s")
    assert greedy >= 0.98 and beam >= 0.98
