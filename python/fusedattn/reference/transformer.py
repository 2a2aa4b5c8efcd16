"""The reference transformer: "Attention is all you need" with the GPT-2 pre-norm option.

Token embeddings + sinusoidal positions; encoder (bidirectional self-attention + padding mask);
decoder (causal self-attention + cross-attention); ReLU or GELU MLP; post-norm or pre-norm.
Three shapes from one config: encoder-decoder (seq2seq), encoder-only (BERT-like) and
decoder-only (GPT-like). Attention, LayerNorm and softmax are modules from
`fusedattn.reference.modules` with torch's state_dict layout, so `fusedattn.swap_modules` can
replace them and one set of weights runs with naive or fused ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..masks import causal_mask
from .modules import LayerNorm, MultiheadAttention


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int = 128
    n_heads: int = 4
    n_encoder_layers: int = 2  # 0: decoder-only
    n_decoder_layers: int = 2  # 0: encoder-only
    d_ff: int = 512
    dropout: float = 0.1
    activation: str = "relu"  # or "gelu"
    norm_first: bool = False  # False: post-norm (Vaswani et al.); True: pre-norm (GPT-2)
    layer_norm_eps: float = 1e-5
    max_len: int = 1024
    pad_id: int = 0
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.n_encoder_layers == 0 and self.n_decoder_layers == 0:
            raise ValueError("a transformer needs encoder or decoder layers")
        if self.activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {self.activation!r}")

    @property
    def kind(self) -> str:
        if self.n_encoder_layers and self.n_decoder_layers:
            return "encoder-decoder"
        return "encoder-only" if self.n_encoder_layers else "decoder-only"


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    """(max_len, d_model): sin on even channels, cos on odd, wavelengths 2π…10000·2π."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(1e4) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * freq)
    pe[:, 1::2] = torch.cos(position * freq)[:, : d_model // 2]
    return pe


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.act = nn.ReLU() if cfg.activation == "relu" else nn.GELU()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class Block(nn.Module):
    """Self-attention (+ cross-attention when `cross`) + MLP, each a residual sublayer."""

    def __init__(self, cfg: TransformerConfig, *, cross: bool):
        super().__init__()
        attn = dict(dropout=cfg.dropout, batch_first=True)
        self.norm_first = cfg.norm_first
        self.self_attn = MultiheadAttention(cfg.d_model, cfg.n_heads, **attn)
        self.norm1 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.cross_attn = MultiheadAttention(cfg.d_model, cfg.n_heads, **attn) if cross else None
        self.norm_cross = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cross else None
        self.ff = FeedForward(cfg)
        self.norm2 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x, norm, fn):
        if self.norm_first:
            return x + self.dropout(fn(norm(x)))
        return norm(x + self.dropout(fn(x)))

    def forward(self, x, *, padding=None, causal=False, memory=None, memory_padding=None):
        """x (B, T, d); padding (B, T) bool, True = pad; memory (B, S, d) for cross-attention."""
        T = x.shape[1]
        # nn.MultiheadAttention's convention: bool True = NOT allowed; is_causal is the hint.
        mask = ~causal_mask(T, T, device=x.device) if causal else None

        def self_attention(h):
            out, _ = self.self_attn(
                h,
                h,
                h,
                key_padding_mask=padding,
                attn_mask=mask,
                need_weights=False,
                is_causal=causal,
            )
            return out

        def cross_attention(h):
            out, _ = self.cross_attn(
                h, memory, memory, key_padding_mask=memory_padding, need_weights=False
            )
            return out

        x = self._sublayer(x, self.norm1, self_attention)
        if self.cross_attn is not None:
            x = self._sublayer(x, self.norm_cross, cross_attention)
        return self._sublayer(x, self.norm2, self.ff)


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # N(0, 1/d), as Vaswani et al.: the sqrt(d)-scaled embedding then has unit scale, like
        # the positions it is added to, and the tied output layer starts with small logits.
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.register_buffer(
            "positions", sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False
        )
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(Block(cfg, cross=False) for _ in range(cfg.n_encoder_layers))
        cross = cfg.n_encoder_layers > 0
        self.decoder = nn.ModuleList(Block(cfg, cross=cross) for _ in range(cfg.n_decoder_layers))
        # Pre-norm stacks end with a norm (GPT-2's ln_f); post-norm ones are already normed.
        self.encoder_norm = self._final_norm(cfg, cfg.n_encoder_layers)
        self.decoder_norm = self._final_norm(cfg, cfg.n_decoder_layers)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @staticmethod
    def _final_norm(cfg: TransformerConfig, layers: int) -> nn.Module:
        if cfg.norm_first and layers:
            return LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        return nn.Identity()

    def _embed(self, tokens):
        T = tokens.shape[1]
        if self.cfg.max_len < T:
            raise ValueError(f"sequence length {T} exceeds max_len {self.cfg.max_len}")
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model) + self.positions[:T].to(
            self.embed.weight.dtype
        )
        return self.embed_dropout(x)

    def encode(self, src):
        """src (B, S) token ids -> memory (B, S, d), src padding (B, S)."""
        padding = src == self.cfg.pad_id
        x = self._embed(src)
        for block in self.encoder:
            x = block(x, padding=padding)
        return self.encoder_norm(x), padding

    def decode(self, tgt, memory=None, memory_padding=None):
        """tgt (B, T) token ids -> logits (B, T, vocab), each position seeing only its past."""
        padding = tgt == self.cfg.pad_id
        x = self._embed(tgt)
        for block in self.decoder:
            x = block(x, padding=padding, causal=True, memory=memory, memory_padding=memory_padding)
        return self.lm_head(self.decoder_norm(x))

    def forward(self, src, tgt=None):
        """encoder-decoder: logits of tgt given src; encoder-only: per-token logits of src;
        decoder-only: next-token logits of src."""
        kind = self.cfg.kind
        if kind == "encoder-decoder":
            if tgt is None:
                raise ValueError("an encoder-decoder model needs tgt")
            memory, memory_padding = self.encode(src)
            return self.decode(tgt, memory, memory_padding)
        if tgt is not None:
            raise ValueError(f"a {kind} model takes one sequence, got tgt too")
        if kind == "encoder-only":
            memory, _ = self.encode(src)
            return self.lm_head(memory)
        return self.decode(src)

    def loss(self, src, tgt=None):
        """Teacher-forced cross-entropy, padding ignored.

        encoder-decoder: tgt = [bos, y1, …, eos] is predicted one step ahead from src;
        decoder-only: src is predicted one step ahead; encoder-only: tgt holds per-token labels
        of src (pad_id where unlabelled, as in masked-LM training).
        """
        pad = self.cfg.pad_id
        kind = self.cfg.kind
        if kind == "encoder-decoder":
            logits, labels = self(src, tgt[:, :-1]), tgt[:, 1:]
        elif kind == "decoder-only":
            logits, labels = self(src[:, :-1]), src[:, 1:]
        else:
            logits, labels = self(src), tgt
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=pad)

    # ---- decoding (no KV cache: each step re-runs the decoder on the prefix; O(T²) steps) ----

    def _decoding_context(self, src, bos_id):
        if self.cfg.kind == "encoder-decoder":
            memory, memory_padding = self.encode(src)
            prefix = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
            return prefix, memory, memory_padding
        if self.cfg.kind == "decoder-only":
            return src, None, None
        raise ValueError("an encoder-only model does not generate")

    def _next_log_probs(self, prefix, memory, memory_padding):
        return F.log_softmax(self.decode(prefix, memory, memory_padding)[:, -1].float(), dim=-1)

    @torch.no_grad()
    def greedy_decode(self, src, max_new_tokens: int, *, bos_id: int = 1, eos_id: int = 2):
        """Generated tokens (B, ≤ max_new_tokens), pad_id after each sequence's eos.

        encoder-decoder: decodes from [bos] given src; decoder-only: continues the prompt src
        (an unpadded batch)."""
        prefix, memory, memory_padding = self._decoding_context(src, bos_id)
        start = prefix.shape[1]
        done = torch.zeros(prefix.shape[0], dtype=torch.bool, device=prefix.device)
        for _ in range(max_new_tokens):
            token = self._next_log_probs(prefix, memory, memory_padding).argmax(-1)
            token = token.masked_fill(done, self.cfg.pad_id)
            prefix = torch.cat([prefix, token[:, None]], dim=1)
            done |= token == eos_id
            if done.all():
                break
        return prefix[:, start:]

    @torch.no_grad()
    def beam_search(
        self,
        src,
        max_new_tokens: int,
        *,
        beam_size: int = 4,
        bos_id: int = 1,
        eos_id: int = 2,
        length_penalty: float = 1.0,
    ):
        """Best hypothesis per sequence (B, ≤ max_new_tokens), pad_id after eos.

        Hypotheses are scored by total log-probability / length**length_penalty; a finished
        hypothesis keeps its score and is extended only by padding. beam_size=1 is greedy.
        """
        prefix, memory, memory_padding = self._decoding_context(src, bos_id)
        B, start = prefix.shape
        V = self.cfg.vocab_size
        prefix = prefix.repeat_interleave(beam_size, dim=0)
        if memory is not None:
            memory = memory.repeat_interleave(beam_size, dim=0)
            memory_padding = memory_padding.repeat_interleave(beam_size, dim=0)
        # Only beam 0 is live at the start, so the first step does not pick k copies.
        scores = torch.full((B, beam_size), float("-inf"), device=prefix.device)
        scores[:, 0] = 0.0
        done = torch.zeros(B, beam_size, dtype=torch.bool, device=prefix.device)
        lengths = torch.zeros(B, beam_size, device=prefix.device)
        for _ in range(max_new_tokens):
            log_probs = self._next_log_probs(prefix, memory, memory_padding).view(B, beam_size, V)
            # A finished hypothesis continues with pad at no cost; nothing else.
            finished = torch.full_like(log_probs, float("-inf"))
            finished[..., self.cfg.pad_id] = 0.0
            log_probs = torch.where(done[..., None], finished, log_probs)
            total = (scores[..., None] + log_probs).view(B, -1)
            scores, flat = total.topk(beam_size, dim=-1)
            beam, token = flat // V, flat % V
            gather = (beam + torch.arange(B, device=beam.device)[:, None] * beam_size).view(-1)
            prefix = torch.cat([prefix[gather], token.view(-1, 1)], dim=1)
            done = done.gather(1, beam)
            lengths = lengths.gather(1, beam) + (~done).float()
            done |= token == eos_id
            if done.all():
                break
        normalised = scores / lengths.clamp(min=1.0) ** length_penalty
        best = normalised.argmax(-1) + torch.arange(B, device=prefix.device) * beam_size
        return prefix[best, start:]
