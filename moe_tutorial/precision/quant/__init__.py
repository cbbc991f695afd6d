"""FP8 and MXFP8 from first principles: exact numerics on any machine, and the recipe per GPU.

Formats
-------
An FP8 number is 1 sign bit, E exponent bits and M mantissa bits. Two formats are used in
training (OCP 8-bit floating point, as in `torch.float8_e4m3fn` / `torch.float8_e5m2`):

======  ====  =========  ==========  ===============  ===============================
format  bias  max        min normal  min subnormal    special values
======  ====  =========  ==========  ===============  ===============================
E4M3    7     448        2^-6        2^-9             NaN = S.1111.111, no infinity
E5M2    15    57344      2^-14       2^-16            inf = S.11111.00, NaN = S.11111.xx
======  ====  =========  ==========  ===============  ===============================

E4M3 has one more mantissa bit (precision), E5M2 more exponent (range): 17.8 binades of range
for E4M3, 31.8 for E5M2, versus 256 for bf16. FP8 therefore always travels with a *scale*
that moves a tensor's values into the format's range before the cast:

* per-tensor scaling: one fp32 scale per tensor, ``scale = 448 / amax`` (TE's
  `Float8CurrentScaling` takes amax from this tensor, `DelayedScaling` from a history of past
  amaxes). One outlier shrinks the scale for everything else, and small values underflow.
* MXFP8 (OCP Microscaling v1.0): every block of 32 consecutive values along one dimension
  shares a power-of-two scale ``2^E`` stored as one E8M0 byte (the biased exponent E + 127);
  the 32 elements are E4M3. Each block gets its own range, so an outlier costs only its block.

Worked example: one block of 32 values whose largest magnitude is 480.0, which also holds
-3.3 and 0.01 (and 29 values between -3 and 3, which do not change the block's scale):

* TE's rule: the smallest ``2^E`` with ``480 / 2^E <= 448`` is ``2^1``, so the scale byte is
  127 + 1 = 128 (0x80) and the elements are ``x / 2``: 240 → E4M3 code 0x77 (exactly 240),
  -1.65 → 0xBD (-1.625), 0.005 → 0x03 (a subnormal, 3 × 2^-9). Decoded × 2:
  480, -3.25, 0.01171875.
* OCP's rule: ``E = floor(log2(480)) - 8 = 0``, byte 127 (0x7F): 480 does not fit and
  saturates to 448 (0x7E); -3.3 → 0xC5 (-3.25); 0.01 → 0x05 (0.009765625). OCP keeps one more
  bit for the small values, TE never clips the block's largest value.

Both rules are here (`rule="te"` / `rule="ocp"`); `quantization_error` measures the difference
on real tensors. The TE rule reproduces TE's arithmetic exactly (the block amax times the fp32
constant 1/448, rounded up to a power of two), so its bytes equal TE's `MXFP8Quantizer`'s
(tests/test_quant_te.py compares them on a Blackwell GPU: TE's MXFP8 quantize kernel does
nothing on Hopper, where TE 2.20 compiles it empty).

Conventions
-----------
* Encoding rounds to nearest, ties to even, and *saturates*: finite values beyond the largest
  normal, and infinities, become ±max (448 for E4M3); NaN stays NaN (0x7F, sign kept). This
  is what NVIDIA's ``cvt.rn.satfinite`` (used by TE) does. E4M3FN has no infinity, so ±inf can
  only saturate (or become NaN). `fp8_encode(..., saturate=False)` gives IEEE-style overflow
  instead (E5M2: ±inf, E4M3: NaN), which is what `.to(torch.float8_*)` did up to torch 2.11;
  from torch 2.12 the E4M3 cast saturates like ours, the E5M2 cast still overflows to inf.
* MXFP8 block maxima ignore NaN (as TE's kernels do); a NaN element stays NaN. An infinite
  element makes its block's scale byte 254 (2^127): the infinity saturates to 448 × 2^127,
  which dequantizes back to inf, and the block's finite values flush to zero (TE does the same).
* Inputs are rounded to float32 first (TE accepts fp32, bf16 and fp16).

Which recipe a machine trains with, and the row alignment each needs, is `moe_tutorial.precision.recipes`;
on a machine without TE the numerics here stand in for the GPU's, so the chapter's measurements
run everywhere.

The package, one job per file:

    formats.py   the FP8 element formats (E4M3, E5M2) bit by bit, and per-tensor scaling
    blocks.py    MXFP8 and FP8 block scaling: power-of-two E8M0 scales per block or tile
    measures.py  what a quantization loses (`rel_error`, `quantization_error`, the range it
                 holds) and what it stores (`bytes_per_element`, `moe_activation_memory`)
"""

from .blocks import (
    E8M0_NAN,
    FP8_BLOCK_TILE,
    MX_BLOCK,
    SCALE_RULES,
    e8m0_to_float,
    mx_scale_from_amax,
    mxfp8_dequantize,
    mxfp8_quantize,
    tile_fake_quantize,
)
from .formats import (
    E4M3,
    E5M2,
    FP8_FORMATS,
    DelayedScaler,
    FP8Format,
    current_scale,
    decode_table,
    fp8_cast,
    fp8_decode,
    fp8_encode,
    per_tensor_dequantize,
    per_tensor_quantize,
)
from .measures import (
    QUANT_METHODS,
    bytes_per_element,
    dynamic_range_histogram,
    error_table,
    fake_quantize,
    moe_activation_memory,
    quantization_error,
    rel_error,
)

__all__ = [
    "DelayedScaler", "E4M3", "E5M2", "E8M0_NAN", "FP8Format", "FP8_BLOCK_TILE", "FP8_FORMATS",
    "MX_BLOCK", "QUANT_METHODS", "SCALE_RULES", "bytes_per_element", "current_scale",
    "decode_table", "dynamic_range_histogram", "e8m0_to_float", "error_table", "fake_quantize",
    "fp8_cast", "fp8_decode", "fp8_encode", "moe_activation_memory", "mx_scale_from_amax",
    "mxfp8_dequantize", "mxfp8_quantize", "per_tensor_dequantize", "per_tensor_quantize",
    "quantization_error", "rel_error", "tile_fake_quantize",
]
