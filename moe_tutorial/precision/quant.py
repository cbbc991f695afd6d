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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius norms, in fp32): how far an output or a gradient is
    from its reference — the measure every notebook, check and benchmark of the course quotes."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------
# FP8 element formats
# ----------------------------------------------------------------------------------------------

_FP32_MANTISSA_BITS = 23
_FP32_BIAS = 127


@dataclass(frozen=True)
class FP8Format:
    """An 8-bit float: 1 sign bit, `exponent_bits`, `mantissa_bits` (OCP FP8)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool  # E5M2 follows IEEE (inf + NaNs); E4M3 "FN" spends that exponent on numbers
    torch_dtype: torch.dtype

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max_exponent_field(self) -> int:
        """Largest exponent field that holds finite numbers."""
        all_ones = 2 ** self.exponent_bits - 1
        return all_ones - 1 if self.has_inf else all_ones

    @property
    def max_code(self) -> int:
        """Code of the largest finite value (E4M3: 0x7E, since 0x7F is NaN; E5M2: 0x7B)."""
        max_mantissa = 2 ** self.mantissa_bits - (1 if self.has_inf else 2)
        return (self.max_exponent_field << self.mantissa_bits) | max_mantissa

    @property
    def max_value(self) -> float:
        return float(decode_table(self)[self.max_code])

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def nan_code(self) -> int:
        return 0x7F

    @property
    def inf_code(self) -> int | None:
        return (self.max_exponent_field + 1) << self.mantissa_bits if self.has_inf else None


E4M3 = FP8Format("e4m3", 4, 3, has_inf=False, torch_dtype=torch.float8_e4m3fn)
E5M2 = FP8Format("e5m2", 5, 2, has_inf=True, torch_dtype=torch.float8_e5m2)
FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def _format(fmt: FP8Format | str) -> FP8Format:
    if isinstance(fmt, FP8Format):
        return fmt
    if fmt not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {sorted(FP8_FORMATS)}")
    return FP8_FORMATS[fmt]


def _check_quantizable(x: torch.Tensor, caller: str, min_dims: int = 0) -> None:
    """Refuse what no quantizer here takes: values that are not floating point (TE quantizes
    fp32, bf16 and fp16), or fewer dimensions than the blocks need."""
    if not x.is_floating_point():
        raise ValueError(f"{caller} quantizes floating-point values, got a {x.dtype} tensor: "
                         f"convert it with x.float() (FP8 codes are read with fp8_decode)")
    if x.dim() < min_dims:
        raise ValueError(f"{caller} needs a tensor of at least {min_dims} dimension(s), got shape "
                         f"{tuple(x.shape)}: reshape it (x.reshape(1, -1) for one row)")


def _check_dim(x: torch.Tensor, dim: int, caller: str) -> None:
    if not -x.dim() <= dim < x.dim():
        fix = (f"pass dim from {-x.dim()} to {x.dim() - 1}" if x.dim() else
               "blocks need a tensor of at least one dimension")
        raise ValueError(f"{caller}: dim={dim} is not a dimension of a tensor of shape "
                         f"{tuple(x.shape)}: {fix}")


@functools.cache
def decode_table(fmt: FP8Format) -> torch.Tensor:
    """The float32 value of each of the 256 codes, straight from the format's definition."""
    m, bias = fmt.mantissa_bits, fmt.bias
    exponent_all_ones = 2 ** fmt.exponent_bits - 1
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> m) & exponent_all_ones
        mantissa = code & (2 ** m - 1)
        if fmt.has_inf and exponent == exponent_all_ones:
            value = math.inf if mantissa == 0 else math.nan
        elif not fmt.has_inf and exponent == exponent_all_ones and mantissa == 2 ** m - 1:
            value = math.nan
        elif exponent == 0:  # subnormal: no implicit leading 1, exponent fixed at 1 - bias
            value = mantissa * 2.0 ** (1 - bias - m)
        else:
            value = (2 ** m + mantissa) * 2.0 ** (exponent - bias - m)
        values.append(sign * value)
    return torch.tensor(values, dtype=torch.float32)


def fp8_decode(codes: torch.Tensor, fmt: FP8Format | str = E4M3) -> torch.Tensor:
    """FP8 codes (uint8, or a float8 tensor of format `fmt`) → float32 values."""
    fmt = _format(fmt)
    if codes.dtype not in (torch.uint8, fmt.torch_dtype):
        raise ValueError(f"fp8_decode reads {fmt.name} codes as uint8 or {fmt.torch_dtype}, got a "
                         f"{codes.dtype} tensor: pass the codes fp8_encode or a quantizer returned "
                         f"(and fmt matching a float8 tensor's format)")
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)
    return decode_table(fmt).to(codes.device)[codes.long()]


def fp8_encode(x: torch.Tensor, fmt: FP8Format | str = E4M3, *, saturate: bool = True
               ) -> torch.Tensor:
    """float → FP8 codes (uint8), round to nearest even, from the bits of the float32 value.

    With `saturate` (the default, what TE does), magnitudes above the largest finite value,
    infinities included, become ±max; without it they become inf (E5M2) or NaN (E4M3).
    NaN → 0x7F with the input's sign bit.
    """
    _check_quantizable(x, "fp8_encode")
    fmt = _format(fmt)
    m, bias = fmt.mantissa_bits, fmt.bias
    bits = x.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    sign = bits >> 31
    magnitude_bits = bits & 0x7FFFFFFF
    exponent_field = magnitude_bits >> _FP32_MANTISSA_BITS
    mantissa_field = magnitude_bits & ((1 << _FP32_MANTISSA_BITS) - 1)

    # value = significand × 2^(exponent - 23), with fp32's implicit leading 1 made explicit.
    is_fp32_normal = exponent_field > 0
    significand = torch.where(is_fp32_normal, mantissa_field | (1 << _FP32_MANTISSA_BITS),
                              mantissa_field)
    exponent = torch.where(is_fp32_normal, exponent_field - _FP32_BIAS, 1 - _FP32_BIAS)

    # Below the FP8 min normal the grid stops shrinking: subnormals share exponent 1 - bias.
    target_exponent = exponent.clamp(min=1 - bias)
    # Keep m fraction bits at the target exponent: drop `shift` low bits of the significand.
    # Past 25 dropped bits everything rounds to zero; the clamp keeps the shifts in range.
    shift = (_FP32_MANTISSA_BITS - m + target_exponent - exponent).clamp(max=40)
    kept = significand >> shift
    dropped = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (dropped > half) | ((dropped == half) & (kept & 1 == 1))
    steps = kept + round_up.long()  # value = steps × 2^(target_exponent - m)

    # Rounding 1.111b up gives 10.000b: renormalise into the next binade.
    carry = steps >> (m + 1)
    steps = steps >> carry
    target_exponent = target_exponent + carry
    is_normal = steps >= (1 << m)
    code = torch.where(is_normal, ((target_exponent + bias) << m) | (steps - (1 << m)), steps)

    # Positive codes are ordered like the values, so "too large" is a comparison of codes.
    overflow = code > fmt.max_code  # includes fp32 infinities (their exponent is huge)
    if saturate:
        code = torch.where(overflow, fmt.max_code, code)
    else:
        code = torch.where(overflow, fmt.inf_code if fmt.has_inf else fmt.nan_code, code)
    code = torch.where(magnitude_bits > 0x7F800000, fmt.nan_code, code)
    return ((sign << 7) | code).to(torch.uint8)


def fp8_cast(x: torch.Tensor, fmt: FP8Format | str = E4M3) -> torch.Tensor:
    """Saturating float → FP8 cast as a torch float8 tensor (no scaling)."""
    _check_quantizable(x, "fp8_cast")
    fmt = _format(fmt)
    return fp8_encode(x, fmt).view(fmt.torch_dtype)


# ----------------------------------------------------------------------------------------------
# Per-tensor scaling (TE's Float8CurrentScaling and DelayedScaling)
# ----------------------------------------------------------------------------------------------

def _nan_ignoring_amax(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| over `dim` (all elements when None), skipping NaNs as TE's kernels do."""
    magnitude = torch.where(torch.isnan(x), 0.0, x.abs())
    return magnitude.amax() if dim is None else magnitude.amax(dim)


def current_scale(amax: torch.Tensor | float, fmt: FP8Format | str = E4M3) -> torch.Tensor:
    """TE's per-tensor scale: ``fmt.max / amax`` in float32; 1 when amax is 0, inf or NaN (no
    information), and the largest float32 when the division overflows (a tiny amax)."""
    fmt = _format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    scale = torch.tensor(fmt.max_value, dtype=torch.float32, device=amax.device) / amax
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    return torch.where((amax == 0) | ~torch.isfinite(amax), 1.0, scale)


def per_tensor_quantize(x: torch.Tensor, fmt: FP8Format | str = E4M3,
                        scale: torch.Tensor | float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: ``data = saturate(x × scale)``, returned with ``scale_inv = 1 / scale``
    (a float32 scalar, what TE's `Float8Tensor` stores). Without `scale`, current scaling:
    the scale comes from this tensor's amax."""
    _check_quantizable(x, "per_tensor_quantize")
    fmt = _format(fmt)
    x32 = x.float()
    scale = current_scale(_nan_ignoring_amax(x32), fmt) if scale is None else \
        torch.as_tensor(scale, dtype=torch.float32, device=x32.device)
    data = fp8_encode(x32 * scale, fmt).view(fmt.torch_dtype)
    return data, 1.0 / scale


def per_tensor_dequantize(data: torch.Tensor, scale_inv: torch.Tensor | float,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `per_tensor_quantize`: the decoded FP8 values times scale_inv."""
    fmt = {E4M3.torch_dtype: E4M3, E5M2.torch_dtype: E5M2}.get(data.dtype)
    if fmt is None:
        raise ValueError(f"expected a float8_e4m3fn or float8_e5m2 tensor, got {data.dtype}")
    return (fp8_decode(data, fmt) * scale_inv).to(dtype)


class DelayedScaler:
    """Delayed scaling for one tensor, as TE's `DelayedScaling` recipe keeps it: each
    quantization uses the scale derived from the amaxes of *earlier* steps (no extra pass over
    the tensor), then records this tensor's amax in a history of `history_len` steps.

    ``scale = fmt.max / reduce(history) / 2^margin`` with reduce = max over the window
    (`algo="max"`) or the most recent amax (`algo="most_recent"`); a zero or non-finite amax
    keeps the previous scale. The first step uses scale 1, as TE does.
    """

    def __init__(self, fmt: FP8Format | str = E4M3, history_len: int = 1024,
                 algo: str = "max", margin: int = 0):
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo={algo!r}: choose 'max' or 'most_recent'")
        if history_len < 1:
            raise ValueError(f"history_len={history_len} must be >= 1")
        self.fmt, self.algo, self.margin = _format(fmt), algo, margin
        self.amax_history = torch.zeros(history_len)  # newest first
        self.scale = torch.tensor(1.0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data, scale_inv = per_tensor_quantize(x, self.fmt, self.scale)
        self.record(_nan_ignoring_amax(x.float()).cpu())
        return data, scale_inv

    def record(self, amax: torch.Tensor | float) -> None:
        """Push an amax into the history and update the scale from it."""
        self.amax_history = torch.roll(self.amax_history, 1)
        self.amax_history[0] = float(amax)
        reduced = self.amax_history.max() if self.algo == "max" else self.amax_history[0]
        if reduced > 0 and torch.isfinite(reduced):
            self.scale = current_scale(reduced, self.fmt) / 2.0 ** self.margin


# ----------------------------------------------------------------------------------------------
# MXFP8 block scaling
# ----------------------------------------------------------------------------------------------

MX_BLOCK = 32
SCALE_RULES = ("te", "ocp")
E8M0_NAN = 255
_E4M3_MAX_EXPONENT = 8  # 448 = 1.75 × 2^8: OCP's emax_elem
# TE multiplies the block amax by this float32 constant (1/448 rounded to float32) instead of
# dividing by 448; reproducing the product bit for bit is what makes our bytes equal TE's.
_RECIPROCAL_OF_448 = 1.0 / 448.0


def _exp2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact 2^e as float32 for integer e in [-149, 127], built from bits (2^-127 and below
    are float32 subnormals)."""
    exponent = exponent.long()
    bits = torch.where(exponent >= -126, (exponent + 127) << _FP32_MANTISSA_BITS,
                       1 << (exponent + 149).clamp(0, 22))
    return bits.to(torch.int32).view(torch.float32)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes → the power of two they encode, 2^(byte - 127); byte 255 is NaN."""
    value = _exp2(scales.long() - 127)
    return torch.where(scales == E8M0_NAN, math.nan, value)


def mx_scale_from_amax(amax: torch.Tensor, rule: str = "te") -> torch.Tensor:
    """Block amax (float32) → E8M0 scale byte (uint8), under one of the two rules.

    * ``"te"``: the smallest power of two ``2^E`` with ``amax / 2^E <= 448``, so no element
      saturates. Computed as TE does: ``amax × fp32(1/448)`` rounded up to a power of two.
      The two agree for every float32 amax except the one just above 448 × 2^-127 (about
      2.6e-36), whose product rounds down to 2^-127 in float32.
    * ``"ocp"``: OCP MX v1.0, ``E = floor(log2(amax)) - 8``: the block's largest value lands in
      [256, 512) and is clipped to 448 when above it.

    Both clamp E to [-127, 127]; amax 0 → byte 0, inf → 254, NaN → 255.
    """
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown MX scale rule {rule!r}; choose one of {SCALE_RULES}")
    amax = amax.float()
    if rule == "te":
        product = amax * torch.tensor(_RECIPROCAL_OF_448, dtype=torch.float32)
        bits = product.view(torch.int32).long()
        exponent_field = bits >> _FP32_MANTISSA_BITS
        mantissa = bits & ((1 << _FP32_MANTISSA_BITS) - 1)
        # Round up to the next power of two unless already one. A float32-subnormal product
        # up to 2^-127 (mantissa 0x400000) fits in byte 0; anything above needs byte 1.
        is_subnormal_within_byte0 = (exponent_field == 0) & (mantissa <= 0x400000)
        round_up = (mantissa > 0) & ~is_subnormal_within_byte0
        biased = exponent_field + round_up.long()
    else:
        bits = amax.view(torch.int32).long()
        # floor(log2(amax)) is the float32 exponent; float32 subnormals are below 2^-126
        # and clamp to the minimum anyway.
        floor_log2 = (bits >> _FP32_MANTISSA_BITS) - _FP32_BIAS
        # amax 0 has exponent -127 and lands on the clamp's byte 0.
        biased = (floor_log2 - _E4M3_MAX_EXPONENT + 127).clamp(0, 254)
    biased = torch.where(torch.isinf(amax), 254, biased)
    biased = torch.where(torch.isnan(amax), E8M0_NAN, biased)
    return biased.to(torch.uint8)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block={block!r} must be a positive integer (MXFP8 uses 32)")


def mxfp8_quantize(x: torch.Tensor, block: int = MX_BLOCK, dim: int = -1, rule: str = "te"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8: blocks of `block` consecutive values along `dim` share one power-of-two scale.

    Returns ``(data, scales)``: `data` has x's shape as `torch.float8_e4m3fn` (the elements
    divided by their block's scale, saturating at ±448); `scales` is uint8 (biased E8M0
    exponents), x's shape with `dim` reduced to ``ceil(size / block)``. ``dim=-1`` is TE's
    rowwise quantization of a [rows, cols] tensor, ``dim=0`` its columnwise one.

    A size that is not a multiple of `block` is padded with zeros to the next multiple (zeros
    do not change a block's amax, so the scales are those of the unpadded values) and the
    padding is dropped from `data`. TE itself requires multiples of 32.
    """
    _check_block(block)
    _check_quantizable(x, "mxfp8_quantize", min_dims=1)
    _check_dim(x, dim, "mxfp8_quantize")
    moved = x.float().movedim(dim, -1)
    size = moved.shape[-1]
    padded = F.pad(moved, (0, -size % block))
    # the block count spelled out: with 0 rows a -1 would be ambiguous
    blocks = padded.reshape(*padded.shape[:-1], padded.shape[-1] // block, block)
    scales = mx_scale_from_amax(_nan_ignoring_amax(blocks, dim=-1), rule)
    # Dividing by 2^E is a multiplication by 2^-E: exact, so only the E4M3 cast rounds.
    elements = blocks * _exp2(127 - scales.long()).unsqueeze(-1)
    codes = fp8_encode(elements, E4M3).reshape(padded.shape)[..., :size]
    data = codes.movedim(-1, dim).contiguous().view(torch.float8_e4m3fn)
    return data, scales.movedim(-1, dim).contiguous()


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, block: int = MX_BLOCK,
                     dim: int = -1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `mxfp8_quantize`: each element times its block's 2^E."""
    _check_block(block)
    if scales.dtype != torch.uint8:
        raise ValueError(f"mxfp8_dequantize reads scales as uint8 E8M0 bytes, got {scales.dtype}: "
                         f"pass the scales mxfp8_quantize returned (not their powers of two)")
    _check_dim(data, dim, "mxfp8_dequantize")
    values = fp8_decode(data, E4M3).movedim(dim, -1)
    scales = scales.movedim(dim, -1)
    size = values.shape[-1]
    expected = (*values.shape[:-1], -(-size // block))
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales of shape {tuple(scales.movedim(-1, dim).shape)} do not match "
                         f"data of shape {tuple(data.shape)} with block={block} along dim={dim}: "
                         f"expected {expected[:-1]} with {expected[-1]} blocks along that dim")
    per_element = e8m0_to_float(scales).repeat_interleave(block, dim=-1)[..., :size]
    return (values * per_element).movedim(-1, dim).to(dtype)


# ----------------------------------------------------------------------------------------------
# Measurements for the chapter
# ----------------------------------------------------------------------------------------------

# name -> what it models
QUANT_METHODS = {
    "fp8_current": "per-tensor E4M3, current scaling (TE Float8CurrentScaling, forward)",
    "fp8_block": "E4M3 in 1x128 tiles, power-of-two scales (TE Float8BlockScaling's "
                 "activations and gradients)",
    "fp8_block_2d": "E4M3 in 128x128 tiles, power-of-two scales (TE Float8BlockScaling's "
                    "weights)",
    "mxfp8_te": "MXFP8, 32-value blocks, TE's scale rule (nothing saturates)",
    "mxfp8_ocp": "MXFP8, 32-value blocks, OCP MX v1.0 scale rule (the block max may clip)",
}


# Block methods -> (block size, scale rule). Float8BlockScaling's power-of-two scale,
# 2^floor(log2(448 / amax)), is the TE MX rule's 2^-E; only the tile size and the fp32 scale
# container differ.
_BLOCK_METHODS = {"fp8_block": (128, "te"), "mxfp8_te": (MX_BLOCK, "te"),
                  "mxfp8_ocp": (MX_BLOCK, "ocp")}


FP8_BLOCK_TILE = 128  # Float8BlockScaling: 1x128 tiles (activations, gradients), 128x128 (weights)


def tile_fake_quantize(x: torch.Tensor, tile: int = FP8_BLOCK_TILE
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one power-of-two scale per `tile` x `tile` square of the last two dims (TE
    Float8BlockScaling's weight tiles; ragged edges are padded with zeros, which do not change
    a tile's amax). Returns what `fake_quantize` returns."""
    _check_block(tile)
    _check_quantizable(x, "tile_fake_quantize", min_dims=2)
    x32 = x.float()
    rows, cols = x32.shape[-2:]
    padded = F.pad(x32, (0, -cols % tile, 0, -rows % tile))
    # [..., R/t, t, C/t, t] -> [..., R/t, C/t, t*t]: one flat group per tile
    tiles = padded.unflatten(-1, (-1, tile)).unflatten(-3, (-1, tile)).transpose(-3, -2)
    scales = mx_scale_from_amax(_nan_ignoring_amax(tiles.flatten(-2), dim=-1), "te")
    per_tile = e8m0_to_float(scales)[..., None, None]
    codes = fp8_encode(tiles * _exp2(127 - scales.long())[..., None, None], E4M3)
    back = (fp8_decode(codes, E4M3) * per_tile).transpose(-3, -2).flatten(-4, -3).flatten(-2)
    limit = (E4M3.max_value * per_tile).expand_as(tiles).transpose(-3, -2).flatten(-4, -3).flatten(-2)
    return back[..., :rows, :cols], limit[..., :rows, :cols]


def fake_quantize(x: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize and dequantize with one of `QUANT_METHODS` (blocks along the last dim; 2-D tiles
    for "fp8_block_2d"). Returns the float32 round trip and, per element, the largest magnitude
    its scale can represent (448 × the element's scale_inv) - values above it saturated."""
    if method not in QUANT_METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(QUANT_METHODS)}")
    # one scale per tensor takes any tensor; blocks need a last dim, 128x128 tiles two
    min_dims = 0 if method == "fp8_current" else 2 if method == "fp8_block_2d" else 1
    _check_quantizable(x, "fake_quantize", min_dims)
    x32 = x.float()
    if method == "fp8_current":
        data, scale_inv = per_tensor_quantize(x32, E4M3)
        return per_tensor_dequantize(data, scale_inv), (E4M3.max_value * scale_inv).expand_as(x32)
    if method == "fp8_block_2d":
        return tile_fake_quantize(x32)
    block, rule = _BLOCK_METHODS[method]
    data, scales = mxfp8_quantize(x32, block=block, rule=rule)
    per_element = e8m0_to_float(scales).repeat_interleave(block, dim=-1)[..., :x32.shape[-1]]
    return mxfp8_dequantize(data, scales, block=block), E4M3.max_value * per_element


def quantization_error(x: torch.Tensor, method: str) -> dict:
    """How much `method` (one of `QUANT_METHODS`) loses on x, over its finite values:
    relative error ||x̂ - x|| / ||x|| and SNR in dB (10·log10 of signal over error power) - both
    dominated by the largest values -, the median over non-zero values of |x̂ - x| / |x| (what
    a typical value loses), the fraction of non-zero values flushed to zero and the fraction
    saturated (clipped)."""
    x_hat, limit = fake_quantize(x, method)
    x32 = x.float()
    # Masks through `where`: boolean indexing is far slower on CPU.
    finite = torch.isfinite(x32)
    signal = torch.where(finite, x32, 0.0).double()
    error = torch.where(finite, x_hat - x32, 0.0).double()
    signal_power, error_power = signal.square().sum().item(), error.square().sum().item()
    nonzero = signal != 0
    relative = torch.where(nonzero, error.abs() / signal.abs(), math.nan)
    numel = max(int(finite.sum()), 1)
    return {
        "method": method,
        "numel": int(finite.sum()),
        "rel_error": math.sqrt(error_power / signal_power) if signal_power else 0.0,
        "snr_db": 10 * math.log10(signal_power / error_power) if error_power else math.inf,
        "median_rel_error": relative.nanmedian().item() if nonzero.any() else 0.0,
        "flushed_to_zero": (nonzero & (x_hat == 0)).sum().item() / numel,
        "saturated": (finite & (x32.abs() > limit)).sum().item() / numel,
    }


def error_table(tensors: dict[str, torch.Tensor], methods=tuple(QUANT_METHODS)) -> list[dict]:
    """`quantization_error` for every tensor × method: one row (a dict) per pair, the tensor's
    name under "tensor" - ready for `pandas.DataFrame(rows)`."""
    return [{"tensor": name, **quantization_error(x, method)}
            for name, x in tensors.items() for method in methods]


def dynamic_range_histogram(x: torch.Tensor, bins: int | None = None, block: int = MX_BLOCK
                            ) -> dict:
    """Where x's magnitudes sit, in powers of two, and how much of it E4M3 can hold.

    `edges`/`counts`: a histogram of log2|x| over the non-zero finite values (one bin per
    binade when `bins` is None). `below_min_subnormal` / `below_min_normal`: the fraction of
    those values that, after scaling, fall below E4M3's smallest subnormal (2^-9: rounded to
    zero or to one subnormal step) or its smallest normal (2^-6: fewer than 3 mantissa bits),
    with one per-tensor scale ("per_tensor") and with MXFP8 blocks along the last dim
    ("per_block", TE's rule).
    """
    x32 = x.float()
    _check_quantizable(x32, "dynamic_range_histogram", min_dims=1)
    nonzero = torch.isfinite(x32) & (x32 != 0)
    log2_magnitude = torch.masked_select(x32, nonzero).abs().log2()
    if log2_magnitude.numel() == 0:
        raise ValueError("dynamic_range_histogram needs at least one non-zero finite value")
    low, high = math.floor(log2_magnitude.min().item()), math.floor(log2_magnitude.max().item()) + 1
    bins = bins or (high - low)
    counts = torch.histc(log2_magnitude.double(), bins=bins, min=low, max=high)
    edges = torch.linspace(low, high, bins + 1)

    scale = current_scale(_nan_ignoring_amax(x32), E4M3)
    per_tensor = torch.masked_select(x32 * scale, nonzero).abs()
    _, scales = mxfp8_quantize(x32, block=block, rule="te")
    block_scale = e8m0_to_float(scales).repeat_interleave(block, dim=-1)[..., :x32.shape[-1]]
    per_block = torch.masked_select(x32 / block_scale, nonzero).abs()
    n = per_tensor.numel()
    return {
        "edges": edges.tolist(),
        "counts": [int(c) for c in counts.tolist()],
        "zeros": int((x32 == 0).sum()),
        "binades_spanned": high - low,
        "e4m3_binades": math.log2(E4M3.max_value / E4M3.min_subnormal),
        "below_min_subnormal": {"per_tensor": (per_tensor < E4M3.min_subnormal).sum().item() / n,
                                "per_block": (per_block < E4M3.min_subnormal).sum().item() / n},
        "below_min_normal": {"per_tensor": (per_tensor < E4M3.min_normal).sum().item() / n,
                             "per_block": (per_block < E4M3.min_normal).sum().item() / n},
    }


def bytes_per_element(fmt: str, block: int = MX_BLOCK) -> float:
    """Storage per value: bf16 2; fp8 1 (plus one fp32 scale per tensor, negligible);
    mxfp8 1 + 1/block (one E8M0 byte per block: 1.03125 for 32)."""
    _check_block(block)
    sizes = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1.0 + 1.0 / block}
    if fmt not in sizes:
        raise ValueError(f"unknown storage format {fmt!r}; choose one of {sorted(sizes)}")
    return sizes[fmt]


def moe_activation_memory(config, tokens: int, fmt: str, block: int = MX_BLOCK) -> dict:
    """Bytes one MoE layer's expert MLP saves for its backward pass, for `tokens` tokens.

    Counted: the permuted input [tokens·top_k, H] (the gate-up GEMM's input, kept for its
    weight gradient), the gate-up output [tokens·top_k, 2I] (SwiGLU's input, kept for SwiGLU's
    backward) and the SwiGLU output [tokens·top_k, I] (the down GEMM's input). With an FP8 or
    MXFP8 recipe TE keeps the two GEMM inputs in that format (one copy, in the direction the
    weight-gradient GEMM reads) while SwiGLU keeps its input in bf16; with bf16 all three are
    bf16. Not counted: router tensors, alignment padding, the unpermuted output.
    """
    routed = tokens * config.top_k
    hidden, inter = config.hidden_size, config.intermediate_size
    rows = [("permuted_input", (routed, hidden), fmt),
            ("gate_up_output", (routed, 2 * inter), "bf16"),
            ("swiglu_output", (routed, inter), fmt)]
    saved = [{"name": name, "shape": shape, "format": f,
              "bytes": shape[0] * shape[1] * bytes_per_element(f, block)}
             for name, shape, f in rows]
    total = sum(row["bytes"] for row in saved)
    bf16_total = sum(r["shape"][0] * r["shape"][1] * bytes_per_element("bf16") for r in saved)
    return {"format": fmt, "tokens": tokens, "routed_rows": routed, "tensors": saved,
            "total_bytes": total, "total_mib": total / 2 ** 20,
            "fraction_of_bf16": total / bf16_total}
