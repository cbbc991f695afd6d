"""The FP8 element formats, E4M3 and E5M2, from their definition: every code's value
(`decode_table`), float → code with round-to-nearest-even and saturation (`fp8_encode`) and
back (`fp8_decode`); and per-tensor scaling, one fp32 scale per tensor (TE's
`Float8CurrentScaling`, `DelayedScaling`). The conventions are the package's (`quant`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

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
