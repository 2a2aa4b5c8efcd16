"""The reference transformer: shapes of the three configurations, masks that really mask,
decoding, and a seq2seq model that learns to reverse digit strings on CPU."""

import math
import time

import pytest
import torch

from fusedattn.reference.transformer import Transformer, TransformerConfig

PAD, BOS, EOS, FIRST_DIGIT, VOCAB = 0, 1, 2, 3, 13


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


def reversal_batch(n, max_len=8, generator=None):
    """src = digits (padded), tgt = [bos, reversed digits, eos] (padded)."""
    src = torch.full((n, max_len), PAD)
    tgt = torch.full((n, max_len + 2), PAD)
    lengths = torch.randint(1, max_len + 1, (n,), generator=generator)
    for i, length in enumerate(lengths.tolist()):
        digits = torch.randint(FIRST_DIGIT, VOCAB, (length,), generator=generator)
        src[i, :length] = digits
        tgt[i, 0], tgt[i, 1 : length + 1], tgt[i, length + 1] = BOS, digits.flip(0), EOS
    return src, tgt


def exact_match(generated, tgt):
    """Share of rows whose generated tokens up to and including eos equal tgt[1:]."""
    hits = 0
    for row, target in zip(generated.tolist(), tgt.tolist(), strict=True):
        answer = [t for t in target[1:] if t != PAD]
        hits += row[: len(answer)] == answer
    return hits / len(tgt)


def test_seq2seq_learns_to_reverse_digits_on_cpu():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    steps = 700
    model = Transformer(
        TransformerConfig(
            vocab_size=VOCAB,
            d_model=64,
            n_heads=4,
            n_encoder_layers=2,
            n_decoder_layers=2,
            d_ff=128,
            dropout=0.0,
            max_len=32,
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    # 50 warm-up steps, then cosine decay to 0: the loss settles near 1e-3 by step 500.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    start = time.perf_counter()
    losses = []
    for _ in range(steps):
        src, tgt = reversal_batch(64)
        loss = model.loss(src, tgt)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    final = sum(losses[-20:]) / 20
    assert final < 0.01, f"final loss {final:.4f} (first {losses[0]:.2f}) after {seconds:.0f}s"
    model.eval()
    src, tgt = reversal_batch(200, generator=torch.Generator().manual_seed(123))
    greedy = exact_match(model.greedy_decode(src, 10, bos_id=BOS, eos_id=EOS), tgt)
    beam = exact_match(model.beam_search(src, 10, beam_size=3, bos_id=BOS, eos_id=EOS), tgt)
    print(f"reversal: loss {final:.4f}, greedy {greedy:.1%}, beam {beam:.1%}, {seconds:.1f}s")
    assert greedy >= 0.98 and beam >= 0.98
