"""MXFP8 and FP8 block scaling: each block of 32 values along one dimension (MXFP8) or each
128 x 128 tile (Float8BlockScaling's weights) shares one power-of-two scale, an E8M0 byte,
under TE's rule or OCP's (the package's docstring works an example through both).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .formats import (
    _FP32_BIAS,
    _FP32_MANTISSA_BITS,
    E4M3,
    _check_dim,
    _check_quantizable,
    _nan_ignoring_amax,
    fp8_decode,
    fp8_encode,
)

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
