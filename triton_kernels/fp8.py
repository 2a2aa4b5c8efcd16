"""FP8 conversions the attention and decode kernels share: rounding fp32 to an fp8 grid
(nearest-even, saturating), the fp8 byte of a value, and reading fp8 in the interpreter.

On a GPU `x.to(tl.float8e4nv)` is the hardware's round-to-nearest-even with saturation and
an fp8 load converts exactly. Triton's CPU interpreter gets both wrong in places (seen with
Triton 3.8: 31.7 -> 16 where the rounding carries into the exponent; NaN codes read as 480;
e5m2 subnormals read as 0 in fp16), so the kernels round and decode with integer and fp32
arithmetic where they run interpreted, and the append writes the byte itself everywhere (it
must match torch's cast bit for bit, -0 and NaN included).

Formats: float8_e4m3fn (E5M2=False: 4 exponent bits, bias 7, 3 mantissa bits, largest 448, no
infinity, NaN 0x7F) and float8_e5m2 (E5M2=True: 5 / 15 / 2, largest 57344, NaN 0x7F here).
"""

from __future__ import annotations

import triton
import triton.language as tl

# (largest finite value, smallest normal exponent, mantissa bits, exponent bias) per format
E4M3_MAX, E4M3_EMIN, E4M3_MBITS, E4M3_BIAS = (tl.constexpr(448.0), tl.constexpr(-6),
                                              tl.constexpr(3), tl.constexpr(7))  # fmt: skip
E5M2_MAX, E5M2_EMIN, E5M2_MBITS, E5M2_BIAS = (tl.constexpr(57344.0), tl.constexpr(-14),
                                              tl.constexpr(2), tl.constexpr(15))  # fmt: skip
# the field masks and the smallest step (a subnormal's unit), per format
E4M3_EMASK, E4M3_MMASK, E4M3_STEP = tl.constexpr(0xF), tl.constexpr(0x7), tl.constexpr(2.0**-9)
E5M2_EMASK, E5M2_MMASK, E5M2_STEP = tl.constexpr(0x1F), tl.constexpr(0x3), tl.constexpr(2.0**-16)


@triton.jit
def round_to_fp8(x, E5M2: tl.constexpr):
    """fp32 x rounded to nearest-even onto the fp8 grid, saturating at the largest finite
    value; NaN stays NaN (the sign of a zero result is not kept). Exact fp32 arithmetic: the
    grid step below |x| is 2^(max(e, emin) - mantissa bits), and (x + c) - c with c = 1.5 *
    2^23 steps rounds x to a multiple of it in fp32's own round-to-nearest-even."""
    MAXV: tl.constexpr = E5M2_MAX if E5M2 else E4M3_MAX
    EMIN: tl.constexpr = E5M2_EMIN if E5M2 else E4M3_EMIN
    MBITS: tl.constexpr = E5M2_MBITS if E5M2 else E4M3_MBITS
    x = x.to(tl.float32)
    big = tl.minimum(tl.maximum(x, -2.0 * MAXV), 2.0 * MAXV)
    e = ((big.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.maximum(e, EMIN) - MBITS
    c = (((step + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(step + 23)
    r = tl.minimum(tl.maximum((big + c) - c, -MAXV), MAXV)
    return tl.where(x != x, x, r)


@triton.jit
def fp8_bits(x, E5M2: tl.constexpr):
    """The fp8 byte (uint8) of x / 1 rounded as round_to_fp8 does: the sign of x kept (-0,
    tiny negatives), NaN 0x7F; what torch's cast writes after fusedattn.fp8.quantize's
    clamp."""
    EMIN: tl.constexpr = E5M2_EMIN if E5M2 else E4M3_EMIN
    MBITS: tl.constexpr = E5M2_MBITS if E5M2 else E4M3_MBITS
    BIAS: tl.constexpr = E5M2_BIAS if E5M2 else E4M3_BIAS
    STEP: tl.constexpr = E5M2_STEP if E5M2 else E4M3_STEP
    x = x.to(tl.float32)
    r = round_to_fp8(x, E5M2)
    bits = r.to(tl.int32, bitcast=True)
    sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    e = ((bits >> 23) & 0xFF) - 127
    normal = e >= EMIN
    code = ((e + BIAS) << MBITS) | ((bits & 0x7FFFFF) >> (23 - MBITS))
    sub = (tl.where(normal | (r != r), 0.0, tl.abs(r)) / STEP).to(tl.int32)  # a subnormal's steps
    code = tl.where(normal, code, sub)
    code = tl.where(x != x, 0x7F, code | sign)
    return code.to(tl.uint8)


@triton.jit
def fp8_to_float(x, E5M2: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp8 x as fp32: the load's own conversion on a GPU, the bits decoded in the
    interpreter."""
    if not INTERPRETED:
        return x.to(tl.float32)
    MBITS: tl.constexpr = E5M2_MBITS if E5M2 else E4M3_MBITS
    BIAS: tl.constexpr = E5M2_BIAS if E5M2 else E4M3_BIAS
    STEP: tl.constexpr = E5M2_STEP if E5M2 else E4M3_STEP
    EMASK: tl.constexpr = E5M2_EMASK if E5M2 else E4M3_EMASK
    MMASK: tl.constexpr = E5M2_MMASK if E5M2 else E4M3_MMASK
    b = x.to(tl.uint8, bitcast=True).to(tl.int32)
    sign = (b & 0x80) << 24
    e = (b >> MBITS) & EMASK
    m = b & MMASK
    normal = ((e - BIAS + 127) << 23) | (m << (23 - MBITS))
    value = tl.where(e == 0, (m.to(tl.float32) * STEP).to(tl.int32, bitcast=True), normal)
    if E5M2:
        special = e == 31
        value = tl.where(special & (m == 0), 0x7F800000, value)
        value = tl.where(special & (m != 0), 0x7FC00000, value)
    else:
        value = tl.where((e == 15) & (m == 7), 0x7FC00000, value)
    return (value | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_to_f16(x, E5M2: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp8 x as fp16 (exact): one cvt per two elements on a GPU, the bits decoded in the
    interpreter."""
    if not INTERPRETED:
        return x.to(tl.float16)
    return fp8_to_float(x, E5M2, INTERPRETED).to(tl.float16)
