"""Hugging Face KV caches kept in fp8, read one byte an element by fusedattn's kernels.

    cache = FP8DynamicCache(config=model.config)                  # grows as HF's DynamicCache
    cache = FP8StaticCache(config=model.config, max_cache_len=n)  # preallocated, as StaticCache
    model.generate(ids, cache=cache, ...)    # model loaded with attn_implementation="fusedattn"

Each layer stores its keys and values in `dtype` (float8_e4m3fn by default, or float8_e5m2)
with one descale per sequence and KV head (flash-attention 3's k_descale / v_descale, float32
(B, Hkv): a stored element means stored × descale). The descales are the layer's own, from
its first update (the prompt): max |x| over the prompt's positions and the head dim / the
type's largest value, so the prompt uses the whole range; or given (`k_descale=`,
`v_descale=`: one value, or a (B, Hkv) tensor, for every layer, or a list with one per layer).
A later token larger than the prompt's largest saturates at the type's largest value
(fusedattn.fp8.quantize: x / descale rounded to nearest-even, saturating).

What each attention call reads: the stored values, dequantized, at every step (the prompt's
too: prefill and decode read the same keys). Under fusedattn's attention the layer hands over
the fp8 storage itself with its descales (in the keyword arguments the model passes from the
cache update on to its attention function) and a decode step reads it in the kernel: half the
bytes of a bf16 cache. Under any other attn_implementation (the config says which), or a model
that does not pass its keyword arguments to the cache update, the layer returns the
dequantized keys and values in the model's dtype: the memory is still halved, the reads are
not.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from .. import fp8
from ..checks import check_descale_values
from . import huggingface

DESCALE_KEYS = ("k_descale", "v_descale")


def _as_descale(name: str, value, device) -> torch.Tensor | None:
    """A given descale as a float32 tensor on `device` (one value, or (B, Hkv)), checked."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(float(value))
    if not value.is_floating_point() or value.dim() not in (0, 1, 2):
        raise ValueError(f"{name} must be a float, or a float tensor of one value or (B, Hkv), "
                         f"got {tuple(value.shape)} {value.dtype}")  # fmt: skip
    if value.dim() == 1 and value.numel() != 1:
        raise ValueError(f"{name} must hold one value or be (B, Hkv), got {tuple(value.shape)}")
    check_descale_values(**{name: value})
    return value.detach().to(device=device, dtype=torch.float32)


def _check_dtype(dtype) -> None:
    if dtype not in fp8.FP8_DTYPES:
        raise ValueError(f"dtype must be one of {fp8.FP8_DTYPES}, got {dtype}")


class FP8LayerMixin:
    """fp8 storage for one of transformers' cache layers (the class it is mixed into keeps its
    own positions, windows and growth; it is handed fp8 states and stores them as they are)."""

    fp8_dtype: torch.dtype = fp8.FORWARD_DTYPE
    read_in_kernels: bool = True
    given: tuple = (None, None)
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None

    def setup_fp8(self, dtype, k_descale, v_descale, read_in_kernels: bool):
        _check_dtype(dtype)
        self.fp8_dtype, self.read_in_kernels = dtype, read_in_kernels
        self.given = (k_descale, v_descale)
        self.k_descale = self.v_descale = None
        return self

    def _calibrate(self, key_states, value_states):
        B, H = key_states.shape[:2]
        device = key_states.device
        given = [_as_descale(n, g, device) for n, g in zip(DESCALE_KEYS, self.given, strict=True)]
        for name, d in zip(DESCALE_KEYS, given, strict=True):
            if d is not None and d.dim() == 2 and tuple(d.shape) != (B, H):
                raise ValueError(f"{name} must be (B, Hkv) = ({B}, {H}), got {tuple(d.shape)}")
        # calibrated: max |x| over the positions and the head dim, per sequence and KV head
        calibrated = [fp8.amax_descale(x, (2, 3), self.fp8_dtype) if d is None else d
                      for x, d in zip((key_states, value_states), given, strict=True)]  # fmt: skip
        self.k_descale, self.v_descale = calibrated

    def _quantize(self, x, descale):
        scale = descale[:, :, None, None] if descale.dim() == 2 else descale.reshape(())
        return fp8.quantize(x, scale, self.fp8_dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.k_descale is None:  # the first update since construction or reset
            self._calibrate(key_states, value_states)
        keys, values = super().update(
            self._quantize(key_states, self.k_descale), self._quantize(value_states, self.v_descale),
            *args, **kwargs,
        )  # fmt: skip
        shared = kwargs.get("kwargs")  # what the model passes on to its attention function
        if self.read_in_kernels and isinstance(shared, dict):
            shared["k_descale"], shared["v_descale"] = self.k_descale, self.v_descale
            return keys, values
        if isinstance(shared, dict):
            for name in DESCALE_KEYS:
                shared.pop(name, None)
        dtype = key_states.dtype
        return (fp8.dequantize_heads(keys, self.k_descale, dtype),
                fp8.dequantize_heads(values, self.v_descale, dtype))  # fmt: skip

    # the descales follow the batch dimension when generate reorders or repeats it
    def _reindex(self, fn):
        for name in ("k_descale", "v_descale"):
            d = getattr(self, name)
            if d is not None and d.dim() == 2:
                setattr(self, name, fn(d))

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._reindex(lambda d: d.index_select(0, beam_idx.to(d.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._reindex(lambda d: d.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._reindex(lambda d: d[indices])

    def reset(self):
        super().reset()
        self.k_descale = self.v_descale = None  # the next prompt calibrates again


class FP8DynamicLayer(FP8LayerMixin, DynamicLayer):
    pass


class FP8DynamicSlidingWindowLayer(FP8LayerMixin, DynamicSlidingWindowLayer):
    pass


class FP8StaticLayer(FP8LayerMixin, StaticLayer):
    pass


class FP8StaticSlidingWindowLayer(FP8LayerMixin, StaticSlidingWindowLayer):
    pass


# transformers' layer types the fp8 caches hold (chunked attention keeps a window's slots too)
DYNAMIC_LAYERS = {
    "full_attention": FP8DynamicLayer,
    "sliding_attention": FP8DynamicSlidingWindowLayer,
    "chunked_attention": FP8DynamicSlidingWindowLayer,
}
STATIC_LAYERS = {
    "full_attention": FP8StaticLayer,
    "sliding_attention": FP8StaticSlidingWindowLayer,
    "chunked_attention": FP8StaticSlidingWindowLayer,
}


def _reads_in_kernels(config) -> bool:
    """Whether the model's attention is fusedattn's (a name `huggingface.register` gave it),
    which takes the fp8 storage and its descales; without a config the caller says so."""
    if config is None:
        return True
    name = getattr(config.get_text_config(decoder=True), "_attn_implementation", None)
    return name in huggingface.REGISTERED


def _per_layer(name: str, value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must have one entry per layer ({n}), got {len(value)}")
        return list(value)
    return [value] * n


def _fp8_layers(config, mapping, layer_kwargs, dtype, k_descale, v_descale, read_in_kernels):
    types, per_layer = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(per_layer, dict):  # transformers 5.17 (the H200 image's): one for all layers
        per_layer = [per_layer] * len(types)
    unsupported = sorted({t for t in types if t not in mapping})
    if unsupported:
        raise ValueError(f"the fp8 caches hold attention layers ({', '.join(mapping)}); this "
                         f"model also has {', '.join(unsupported)} layers")  # fmt: skip
    ks = _per_layer("k_descale", k_descale, len(types))
    vs = _per_layer("v_descale", v_descale, len(types))
    return [
        mapping[t](**layer_kwargs, **kw).setup_fp8(dtype, k, v, read_in_kernels)
        for t, kw, k, v in zip(types, per_layer, ks, vs, strict=True)
    ]


class FP8DynamicCache(DynamicCache):
    """transformers' DynamicCache with each layer's keys and values in fp8 (module docstring).
    With `config` (the model's) the layers follow its layer types (sliding windows kept to the
    window) and the config says whether the attention is fusedattn's; without one every layer
    grows as a full-attention layer and is read as fp8 (fusedattn's attention is assumed)."""

    def __init__(self, config=None, *, dtype=fp8.FORWARD_DTYPE, k_descale=None, v_descale=None,
                 offloading: bool = False, offload_only_non_sliding: bool = False):  # fmt: skip
        _check_dtype(dtype)
        reads = _reads_in_kernels(config)
        if config is None:
            if isinstance(k_descale, (list, tuple)) or isinstance(v_descale, (list, tuple)):
                raise ValueError("per-layer descales need the model's config")
            layer = functools.partial(_replicated_layer, dtype, k_descale, v_descale, reads)
            DynamicCache.__init__(self, offloading=offloading,
                                  offload_only_non_sliding=offload_only_non_sliding)  # fmt: skip
            self.layer_class_to_replicate = layer
            return
        layers = _fp8_layers(config, DYNAMIC_LAYERS, {}, dtype, k_descale, v_descale, reads)
        super(DynamicCache, self).__init__(layers=layers, offloading=offloading,
                                           offload_only_non_sliding=offload_only_non_sliding)  # fmt: skip


def _replicated_layer(dtype, k_descale, v_descale, reads):
    return FP8DynamicLayer().setup_fp8(dtype, k_descale, v_descale, reads)


class FP8StaticCache(StaticCache):
    """transformers' StaticCache (preallocated, torch.compile-friendly) with each layer's keys
    and values in fp8 (module docstring): max_cache_len slots of one byte an element."""

    def __init__(self, config, max_cache_len: int, *, dtype=fp8.FORWARD_DTYPE, k_descale=None,
                 v_descale=None, offloading: bool = False,
                 offload_only_non_sliding: bool = True, **kwargs):  # fmt: skip
        layers = _fp8_layers(config, STATIC_LAYERS, dict(max_cache_len=max_cache_len), dtype,
                             k_descale, v_descale, _reads_in_kernels(config))  # fmt: skip
        super(StaticCache, self).__init__(layers=layers, offloading=offloading,
                                          offload_only_non_sliding=offload_only_non_sliding)  # fmt: skip


def cache_bytes(cache) -> int:
    """The bytes a cache's layers hold in keys and values (for comparing fp8 with bf16)."""
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )
