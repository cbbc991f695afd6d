"""moe_tutorial.precision.quant on CPU: FP8 formats against torch's casts, hand-derived edge cases,
MXFP8 invariants under both scale rules, the chapter's measurements and the recipe choice."""

import math
from fractions import Fraction

import pytest
import torch

from moe_tutorial.course import probes
from moe_tutorial.moe.config import preset
from moe_tutorial.precision import quant
from moe_tutorial.precision.quant import E4M3, E5M2

POS_INF = torch.tensor(math.inf)


def codes(values, fmt=E4M3, **kwargs):
    return quant.fp8_encode(torch.tensor(values, dtype=torch.float32), fmt, **kwargs).tolist()


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


def outlier_matrix(rows=64, cols=256, seed=0):
    """Gaussian rows whose 32-blocks have scales spread over ±6 binades, plus a few huge values."""
    g = generator(seed)
    x = torch.randn(rows, cols, generator=g)
    x *= torch.exp2(torch.randn(rows, cols // 32, 1, generator=g) * 6).repeat_interleave(32, -1).view(rows, cols)
    x.view(-1)[torch.randint(0, rows * cols, (10,), generator=g)] *= 1e4
    return x


# ---------------------------------------------------------------------------------------------
# FP8 element formats
# ---------------------------------------------------------------------------------------------

def test_format_constants():
    assert (E4M3.bias, E4M3.max_value, E4M3.max_code, E4M3.inf_code) == (7, 448.0, 0x7E, None)
    assert (E4M3.min_normal, E4M3.min_subnormal) == (2.0 ** -6, 2.0 ** -9)
    assert (E5M2.bias, E5M2.max_value, E5M2.max_code, E5M2.inf_code) == (15, 57344.0, 0x7B, 0x7C)
    assert (E5M2.min_normal, E5M2.min_subnormal) == (2.0 ** -14, 2.0 ** -16)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_decode_matches_torch_for_all_256_codes(fmt):
    all_codes = torch.arange(256, dtype=torch.uint8)
    ours, theirs = quant.fp8_decode(all_codes, fmt), all_codes.view(fmt.torch_dtype).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])


def _torch_e4m3_cast_saturates() -> bool:
    """torch <= 2.11 turned finite E4M3 overflow into NaN; torch >= 2.12 saturates."""
    return torch.tensor(1000.0).to(torch.float8_e4m3fn).float().item() == 448.0


def _grid_values(fmt):
    """Every finite value, every midpoint between neighbours (the ties), and random values over
    the whole range including overflow, both signs."""
    table = quant.decode_table(fmt)
    finite = table[torch.isfinite(table)]
    positive = torch.unique(finite.abs().double())
    midpoints = ((positive[1:] + positive[:-1]) / 2).float()
    g = generator(1)
    log_uniform = torch.exp2(torch.rand(50_000, generator=g) * 44 - 22)
    wide = torch.exp2(torch.rand(5_000, generator=g) * 250 - 125) * fmt.max_value / 2 ** 60
    values = torch.cat([finite, midpoints, log_uniform, wide, torch.randn(20_000, generator=g)])
    return torch.cat([values, -values])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_encode_matches_torch_cast_on_grid_ties_and_random_values(fmt):
    x = _grid_values(fmt)
    reference = x.to(fmt.torch_dtype).view(torch.uint8)
    # torch's E5M2 cast overflows to inf; its E4M3 cast saturates from torch 2.12 on.
    saturate = fmt is E4M3 and _torch_e4m3_cast_saturates()
    ours = quant.fp8_encode(x, fmt, saturate=saturate)
    mismatch = ours != reference
    assert not mismatch.any(), (f"{int(mismatch.sum())} of {x.numel()} differ, e.g. "
                                f"{x[mismatch][:5].tolist()} -> {ours[mismatch][:5].tolist()} "
                                f"vs torch {reference[mismatch][:5].tolist()}")


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_encode_of_every_value_in_range_round_trips_within_half_a_step(fmt):
    x = _grid_values(fmt)
    x = x[x.abs() <= fmt.max_value]
    error = (quant.fp8_decode(quant.fp8_encode(x, fmt), fmt) - x).abs()
    half_step = torch.maximum(x.abs() * 2.0 ** -(fmt.mantissa_bits + 1),
                              torch.tensor(fmt.min_subnormal / 2))
    assert (error <= half_step).all()


# value -> E4M3 code, derived by hand from S.EEEE.MMM with bias 7 (round to nearest even,
# saturating): 1.0 = 0.0111.000, 448 = 0.1111.110, 2^-9 = 0.0000.001, ...
E4M3_CASES = [
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-1.0, 0xB8), (1.125, 0x39), (240.0, 0x77),
    (1.0625, 0x38),        # tie between 1.0 (mantissa 000) and 1.125 (001): even → 1.0
    (1.1875, 0x3A),        # tie between 1.125 (001) and 1.25 (010): even → 1.25
    (432.0, 0x7E),         # tie between 416 (110 1) and 448 (111 0): even → 448
    (448.0, 0x7E), (449.0, 0x7E), (464.0, 0x7E), (1e9, 0x7E),  # saturate at 448
    (math.inf, 0x7E), (-math.inf, 0xFE),  # no infinity in E4M3FN: saturate like cvt.satfinite
    (math.nan, 0x7F), (-math.nan, 0xFF),
    (2.0 ** -6, 0x08),     # smallest normal
    (2.0 ** -9, 0x01),     # smallest subnormal
    (2.0 ** -10, 0x00),    # half the smallest subnormal: tie → even (zero)
    (1.5 * 2.0 ** -10, 0x01), (3 * 2.0 ** -10, 0x02),  # 1.5 steps → 2 (even)
    (7.5 * 2.0 ** -9, 0x08),  # tie between the largest subnormal 0x07 and the smallest normal
    (-2.0 ** -12, 0x80),   # underflow keeps the sign: -0
]


@pytest.mark.parametrize("value,code", E4M3_CASES)
def test_e4m3_hand_derived_codes(value, code):
    assert codes([value]) == [code]


E5M2_CASES = [(1.0, 0x3C), (57344.0, 0x7B), (61439.0, 0x7B), (2.0 ** -16, 0x01),
              (2.0 ** -14, 0x04), (1.125, 0x3C), (1.375, 0x3E)]


@pytest.mark.parametrize("value,code", E5M2_CASES)
def test_e5m2_hand_derived_codes(value, code):
    assert codes([value], E5M2) == [code]


def test_overflow_saturates_by_default_and_overflows_without_saturation():
    big = [61440.0, 1e30, math.inf, -math.inf]
    assert codes(big, E5M2) == [0x7B, 0x7B, 0x7B, 0xFB]
    assert codes(big, E5M2, saturate=False) == [0x7C, 0x7C, 0x7C, 0xFC]
    assert codes([465.0, 480.0, math.inf], E4M3, saturate=False) == [0x7F, 0x7F, 0x7F]
    assert codes([464.0], E4M3, saturate=False) == [0x7E]  # the tie still rounds down to 448


def test_fp8_cast_returns_a_torch_float8_tensor():
    out = quant.fp8_cast(torch.tensor([1.0, 500.0]), "e4m3")
    assert out.dtype == torch.float8_e4m3fn and out.float().tolist() == [1.0, 448.0]
    with pytest.raises(ValueError, match="unknown FP8 format"):
        quant.fp8_cast(torch.ones(1), "e3m4")


# ---------------------------------------------------------------------------------------------
# Per-tensor scaling
# ---------------------------------------------------------------------------------------------

def test_current_scaling_uses_fp8_max_over_amax_and_round_trips():
    x = torch.randn(1000, generator=generator()) * 3
    data, scale_inv = quant.per_tensor_quantize(x)
    amax = x.abs().max()
    assert data.dtype == torch.float8_e4m3fn
    assert scale_inv.item() == (1.0 / (torch.tensor(448.0) / amax)).item()
    assert data.float().abs().max().item() == 448.0  # the amax lands exactly on the max
    restored = quant.per_tensor_dequantize(data, scale_inv)
    assert ((restored - x).abs() <= x.abs() / 16 + 2.0 ** -10 * scale_inv).all()


@pytest.mark.parametrize("amax,scale", [(0.0, 1.0), (math.inf, 1.0), (math.nan, 1.0),
                                        (448.0, 1.0), (2.0, 224.0),
                                        (1e-40, torch.finfo(torch.float32).max)])
def test_current_scale_special_cases(amax, scale):
    assert quant.current_scale(amax).item() == pytest.approx(scale, rel=1e-7)


def test_per_tensor_e5m2_and_explicit_scale():
    data, scale_inv = quant.per_tensor_quantize(torch.tensor([1.0, -2.0]), "e5m2", scale=4.0)
    assert data.dtype == torch.float8_e5m2 and scale_inv.item() == 0.25
    assert quant.per_tensor_dequantize(data, scale_inv).tolist() == [1.0, -2.0]
    with pytest.raises(ValueError, match="float8"):
        quant.per_tensor_dequantize(torch.ones(2), scale_inv)


def test_delayed_scaling_uses_the_history_of_earlier_steps():
    scaler = quant.DelayedScaler(history_len=3)
    _, first_scale_inv = scaler.quantize(torch.tensor([2.0, -1.0]))
    assert first_scale_inv.item() == 1.0  # nothing recorded yet: scale 1
    _, second = scaler.quantize(torch.tensor([8.0]))
    assert second.item() == pytest.approx(2.0 / 448.0)  # from step 1's amax (2), not this step's (8)
    scaler.quantize(torch.tensor([1.0]))
    scaler.quantize(torch.tensor([1.0]))  # 8 is still in the 3-step window
    assert scaler.scale.item() == pytest.approx(448.0 / 8)
    scaler.quantize(torch.tensor([1.0]))  # now it has left the window
    assert scaler.scale.item() == pytest.approx(448.0)


def test_delayed_scaling_most_recent_margin_and_zero_amax():
    scaler = quant.DelayedScaler(history_len=4, algo="most_recent", margin=1)
    scaler.record(8.0)
    scaler.record(2.0)
    assert scaler.scale.item() == pytest.approx(448.0 / 2 / 2)
    scaler.record(0.0)  # an all-zero step carries no information: keep the scale
    assert scaler.scale.item() == pytest.approx(448.0 / 2 / 2)
    with pytest.raises(ValueError, match="algo"):
        quant.DelayedScaler(algo="mean")


# ---------------------------------------------------------------------------------------------
# MXFP8: scale rules
# ---------------------------------------------------------------------------------------------

NEXT_ABOVE_448 = torch.nextafter(torch.tensor(448.0), POS_INF).item()
NEXT_BELOW_448 = torch.nextafter(torch.tensor(448.0), torch.tensor(0.0)).item()

# block amax -> (TE byte, OCP byte). TE: smallest E with amax / 2^E <= 448; OCP:
# floor(log2(amax)) - 8; byte = E + 127, clamped to [0, 254].
SCALE_CASES = [
    (0.0, 0, 0),                 # all-zero block: smallest scale
    (448.0, 127, 127),           # 448 / 2^0 fits exactly; floor(log2 448) = 8
    (NEXT_ABOVE_448, 128, 127),  # TE must halve; OCP keeps 2^0 and clips to 448
    (NEXT_BELOW_448, 127, 127),
    (480.0, 128, 127),           # the docstring's worked example
    (512.0, 128, 128),
    (1.0, 119, 119),             # 1 / 2^-8 = 256 <= 448 < 512
    (1.75, 119, 119),            # 1.75 × 2^8 = 448 exactly
    (1.76, 120, 119),
    (3.5, 120, 120), (3.6, 121, 120),
    (2.0 ** -118, 1, 1),         # 2^-118 / 2^-126 = 256
    (2.0 ** -120, 0, 0),         # would need 2^-129: clamped to the smallest, 2^-127
    (3.4028234663852886e38, 247, 246),  # float32 max: 2^119.2 after / 448
    (math.inf, 254, 254),        # largest scale: the inf saturates, the rest flushes
    (math.nan, 255, 255),
]


@pytest.mark.parametrize("amax,te_byte,ocp_byte", SCALE_CASES)
def test_scale_byte_hand_derived_under_both_rules(amax, te_byte, ocp_byte):
    amax = torch.tensor([amax], dtype=torch.float32)
    assert quant.mx_scale_from_amax(amax, "te").item() == te_byte
    assert quant.mx_scale_from_amax(amax, "ocp").item() == ocp_byte


def _smallest_exponent_fitting_448(amax: float) -> int:
    """The TE rule from its definition, in exact rational arithmetic."""
    exponent = math.floor(math.log2(amax / 448)) - 1
    while Fraction(amax) > 448 * Fraction(2) ** exponent:
        exponent += 1
    return max(exponent, -127)


def test_te_rule_arithmetic_equals_its_definition_except_at_one_tiny_amax():
    g = generator(2)
    boundaries = torch.tensor([448 * 2.0 ** k for k in range(-126, 119)])
    amax = torch.cat([torch.exp2(torch.rand(5000, generator=g) * 240 - 120), boundaries,
                      torch.nextafter(boundaries, POS_INF),
                      torch.nextafter(boundaries, torch.tensor(0.0))])
    ours = quant.mx_scale_from_amax(amax, "te").long() - 127
    exact = torch.tensor([_smallest_exponent_fitting_448(a) for a in amax.tolist()])
    assert torch.equal(ours, exact)
    # TE's float32 product amax × fp32(1/448) rounds the next float above 448 × 2^-127 down to
    # exactly 2^-127, so TE (and we) keep byte 0 there: that one value saturates to 448.
    just_above = torch.nextafter(torch.tensor([448 * 2.0 ** -127]), POS_INF)
    assert quant.mx_scale_from_amax(just_above, "te").item() == 0
    assert _smallest_exponent_fitting_448(just_above.item()) == -126


def test_unknown_rule_and_bad_block_are_errors():
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        quant.mxfp8_quantize(torch.ones(32), rule="floor")
    with pytest.raises(ValueError, match="block"):
        quant.mxfp8_quantize(torch.ones(32), block=0)
    with pytest.raises(ValueError, match="floating-point"):
        quant.mxfp8_quantize(torch.ones(32, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# MXFP8: quantize / dequantize
# ---------------------------------------------------------------------------------------------

def test_worked_example_from_the_module_docstring():
    block = torch.zeros(32)
    block[:3] = torch.tensor([480.0, -3.3, 0.01])
    expected = {"te": (0x80, [0x77, 0xBD, 0x03], [480.0, -3.25, 0.01171875]),
                "ocp": (0x7F, [0x7E, 0xC5, 0x05], [448.0, -3.25, 0.009765625])}
    for rule, (scale_byte, element_codes, decoded) in expected.items():
        data, scales = quant.mxfp8_quantize(block, rule=rule)
        assert scales.tolist() == [scale_byte]
        assert data.view(torch.uint8)[:3].tolist() == element_codes
        assert quant.mxfp8_dequantize(data, scales)[:3].tolist() == decoded


@pytest.mark.parametrize("rule", quant.SCALE_RULES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_block_invariants(rule, dim):
    x = outlier_matrix()
    data, scales = quant.mxfp8_quantize(x, dim=dim, rule=rule)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scales.dtype == torch.uint8
    assert scales.shape == ((64, 8) if dim == -1 else (2, 256))

    scale = quant.e8m0_to_float(scales).double()
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all(), "every scale is a power of two"

    blocks = x.movedim(dim, -1).reshape(*x.movedim(dim, -1).shape[:-1], -1, 32).double()
    ratio = blocks.abs().amax(-1) / scale.movedim(dim, -1)
    if rule == "te":  # the smallest power of two that fits: no block max above 448
        assert (ratio <= 448).all() and (ratio > 224).all()
    else:  # OCP puts the block max in [256, 512)
        assert (ratio >= 256).all() and (ratio < 512).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_bounded_by_the_e4m3_step(dtype):
    x = outlier_matrix().to(dtype)
    data, scales = quant.mxfp8_quantize(x, rule="te")
    restored = quant.mxfp8_dequantize(data, scales)
    x32 = x.float()
    block_scale = quant.e8m0_to_float(scales).repeat_interleave(32, -1)
    # Half a step: 2^-4 relative in E4M3's normal range, 2^-10 × scale among its subnormals.
    bound = torch.maximum(x32.abs() / 16, block_scale * 2.0 ** -10)
    assert ((restored - x32).abs() <= bound).all()


def test_columnwise_is_rowwise_of_the_transpose_and_bf16_equals_its_float32_values():
    x = outlier_matrix().to(torch.bfloat16)
    col_data, col_scales = quant.mxfp8_quantize(x, dim=0)
    row_data, row_scales = quant.mxfp8_quantize(x.float().t().contiguous(), dim=-1)
    assert torch.equal(col_data.view(torch.uint8), row_data.view(torch.uint8).t())
    assert torch.equal(col_scales, row_scales.t())
    restored = quant.mxfp8_dequantize(col_data, col_scales, dim=0)
    assert torch.equal(restored, quant.mxfp8_dequantize(row_data, row_scales).t())


def test_sizes_that_are_not_a_multiple_of_32_are_zero_padded():
    x = torch.randn(3, 40, generator=generator())
    data, scales = quant.mxfp8_quantize(x)
    assert data.shape == (3, 40) and scales.shape == (3, 2)
    padded_data, padded_scales = quant.mxfp8_quantize(torch.nn.functional.pad(x, (0, 24)))
    assert torch.equal(data.view(torch.uint8), padded_data.view(torch.uint8)[:, :40])
    assert torch.equal(scales, padded_scales)
    assert quant.mxfp8_dequantize(data, scales).shape == (3, 40)
    with pytest.raises(ValueError, match="do not match"):
        quant.mxfp8_dequantize(data, scales[:, :1])


def test_zero_blocks_subnormals_inf_and_nan():
    x = torch.zeros(4, 32)
    # In subnormal steps of 2^-9: 1.25 → 1, 1.5 (a tie) → 2 (even), 0.5 (a tie) → 0 (even).
    x[1, :4] = torch.tensor([448.0, 1.25 * 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -10])
    x[2, 0], x[2, 1], x[2, 2] = math.inf, 5.0, -math.inf
    x[3, 0], x[3, 1] = math.nan, 3.0
    data, scales = quant.mxfp8_quantize(x)
    raw = data.view(torch.uint8)
    assert scales[:, 0].tolist() == [0, 127, 254, 127 - 7]  # max 3 → 3 × 2^7 = 384 <= 448
    assert raw[0].eq(0).all()
    assert raw[1, :4].tolist() == [0x7E, 0x01, 0x02, 0x00]
    assert raw[2, :3].tolist() == [0x7E, 0x00, 0xFE]  # inf saturates, 5 × 2^-127 flushes
    # NaN is ignored by the block max and stays NaN; 3 × 2^7 = 384 = 1.5 × 2^8 → 0.1111.100
    assert raw[3, :2].tolist() == [0x7F, 0x7C]
    restored = quant.mxfp8_dequantize(data, scales)
    assert restored[2, :3].tolist() == [math.inf, 0.0, -math.inf]
    assert math.isnan(restored[3, 0]) and restored[3, 1].item() == 3.0
    assert math.isnan(quant.e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())


def test_three_dimensional_input_blocks_along_the_chosen_dim():
    x = torch.randn(2, 64, 3, generator=generator())
    data, scales = quant.mxfp8_quantize(x, dim=1)
    assert scales.shape == (2, 2, 3)
    reference, _ = quant.mxfp8_quantize(x.movedim(1, -1))
    assert torch.equal(data.view(torch.uint8), reference.view(torch.uint8).movedim(-1, 1))


def test_agrees_with_torchao_mx_reference():
    """torchao's MX reference (prototype.mx_formats.to_mx): RCEIL is TE's rule, FLOOR is OCP's.
    The block maxima stay far above 448 × 2^-127: for blocks with scale byte 0 torchao scales
    the elements by something other than the 2^127 the byte encodes (RCEIL by 1, FLOOR by
    2^126), so its elements differ from TE's and ours there."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor",
                                    reason="torchao is not installed (pip install --no-deps torchao)")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = outlier_matrix(seed=3)
    for rule, mode in (("te", ScaleCalculationMode.RCEIL), ("ocp", ScaleCalculationMode.FLOOR)):
        their_scales, their_data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=mode)
        data, scales = quant.mxfp8_quantize(x, rule=rule)
        assert torch.equal(their_scales.view(torch.uint8), scales), f"scales, rule={rule}"
        assert torch.equal(their_data.view(torch.uint8), data.view(torch.uint8)), f"data, {rule}"


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------

def test_quantization_error_metrics():
    exact = torch.tensor([1.0, -2.0, 448.0, 0.5] * 8)
    row = quant.quantization_error(exact, "mxfp8_te")
    assert row["rel_error"] == 0.0 and row["snr_db"] == math.inf and row["numel"] == 32

    x = outlier_matrix()
    rows = {m: quant.quantization_error(x, m) for m in quant.QUANT_METHODS}
    for row in rows.values():
        assert row["snr_db"] == pytest.approx(-20 * math.log10(row["rel_error"]))
    assert rows["mxfp8_te"]["saturated"] == 0.0 and rows["fp8_current"]["saturated"] == 0.0
    assert rows["mxfp8_ocp"]["saturated"] > 0.0
    # One per-tensor scale sends the blocks far below the outliers under E4M3's range: most
    # values flush to zero (median relative error 100%), while the SNR, dominated by the
    # outliers, stays high. Per-block scales keep the typical value's error at E4M3's few %.
    assert rows["fp8_current"]["flushed_to_zero"] > 0.5
    assert rows["fp8_current"]["median_rel_error"] == 1.0
    assert rows["mxfp8_te"]["flushed_to_zero"] < 0.001
    assert rows["mxfp8_te"]["median_rel_error"] < 1 / 16
    with pytest.raises(ValueError, match="unknown method"):
        quant.quantization_error(x, "nvfp4")


def test_dynamic_range_histogram():
    x = outlier_matrix()
    x[0, :5] = 0.0
    hist = quant.dynamic_range_histogram(x)
    assert sum(hist["counts"]) == x.numel() - 5 and hist["zeros"] == 5
    assert len(hist["edges"]) == len(hist["counts"]) + 1 == hist["binades_spanned"] + 1
    assert hist["binades_spanned"] > hist["e4m3_binades"] > 17
    tensor_below = hist["below_min_subnormal"]["per_tensor"]
    assert tensor_below > 0.01 and hist["below_min_subnormal"]["per_block"] < tensor_below / 10
    assert hist["below_min_normal"]["per_tensor"] >= tensor_below
    assert len(quant.dynamic_range_histogram(x, bins=10)["counts"]) == 10


def test_bytes_per_element_and_moe_activation_memory():
    assert [quant.bytes_per_element(f) for f in ("bf16", "fp8", "mxfp8")] == [2.0, 1.0, 1.03125]
    assert quant.bytes_per_element("mxfp8", block=16) == 1.0625
    with pytest.raises(ValueError, match="unknown storage format"):
        quant.bytes_per_element("fp4")

    cfg = preset("tiny")  # H=32, I=64, top_k=2
    bf16 = quant.moe_activation_memory(cfg, tokens=100, fmt="bf16")
    assert bf16["routed_rows"] == 200
    assert [t["bytes"] for t in bf16["tensors"]] == [200 * 32 * 2, 200 * 128 * 2, 200 * 64 * 2]
    mx = quant.moe_activation_memory(cfg, tokens=100, fmt="mxfp8")
    assert mx["total_bytes"] == 200 * 32 * 1.03125 + 200 * 128 * 2 + 200 * 64 * 1.03125
    assert mx["fraction_of_bf16"] == pytest.approx(mx["total_bytes"] / bf16["total_bytes"])


@pytest.fixture(scope="module")
def model_tensors():
    return probes.realistic_tensors(batch=4, seq_len=32)


def test_realistic_tensors_come_from_a_real_backward_pass(model_tensors):
    cfg = preset("tiny")
    tokens = 4 * 32
    expected = {"activations": (tokens, 32), "activations_outliers": (tokens, 32),
                "weights": (cfg.num_experts * 2 * cfg.intermediate_size, 32),
                "weight_gradients": (cfg.num_experts * 2 * cfg.intermediate_size, 32),
                "activation_gradients": (tokens, 32)}
    assert {name: tuple(t.shape) for name, t in model_tensors.items()} == expected
    for name, t in model_tensors.items():
        assert torch.isfinite(t).all() and t.abs().max() > 0, name
    ratio = model_tensors["activations_outliers"].abs().amax(0) / model_tensors["activations"].abs().amax(0)
    assert (ratio == 100).sum() == 2 and (ratio == 1).sum() == 30


def test_error_table_on_model_tensors(model_tensors):
    rows = quant.error_table(model_tensors)
    assert len(rows) == len(model_tensors) * len(quant.QUANT_METHODS)
    for row in rows:
        # E4M3 keeps 3 mantissa bits: a few percent of error, never more than 1/16.
        assert 0 < row["rel_error"] < 1 / 16, row
    by_key = {(r["tensor"], r["method"]): r for r in rows}
    for name in model_tensors:
        assert by_key[(name, "mxfp8_te")]["saturated"] == 0.0
        assert by_key[(name, "mxfp8_te")]["snr_db"] > by_key[(name, "mxfp8_ocp")]["snr_db"]


def test_fp8_block_2d_uses_one_scale_per_128x128_tile():
    torch.manual_seed(0)
    w = torch.randn(200, 300)
    w[5, 7] = 1000.0  # an outlier in tile (0, 0) only
    back, limit = quant.fake_quantize(w, "fp8_block_2d")
    assert back.shape == w.shape
    assert limit[:128, :128].unique().numel() == 1 and limit[0, 0] >= 1000.0
    assert limit[128:, :128].max() < 1000.0 and limit[:128, 128:256].max() < 1000.0
    # one tile quantized alone, as one MX block of 128*128 values, gives the same bytes
    data, scales = quant.mxfp8_quantize(w[128:, 256:].reshape(1, -1), block=72 * 44)
    alone = quant.mxfp8_dequantize(data, scales, block=72 * 44).reshape(72, 44)
    assert torch.equal(back[128:, 256:], alone)


@pytest.mark.parametrize("dim", [-1, 0])
def test_mxfp8_of_a_tensor_with_no_rows_is_empty_not_an_error(dim):
    """An expert that got no tokens hands MXFP8 a [0, hidden] tensor: empty data and scales,
    dequantized back to the empty tensor."""
    data, scales = quant.mxfp8_quantize(torch.zeros(0, 64), dim=dim)
    assert data.shape == (0, 64) and scales.shape == ((0, 2) if dim == -1 else (0, 64))
    assert quant.mxfp8_dequantize(data, scales, dim=dim).shape == (0, 64)
