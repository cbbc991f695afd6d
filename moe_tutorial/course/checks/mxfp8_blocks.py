"""Exercise 03's check: MXFP8 quantization of a tensor, block by block (its first case is one block,
the worked example)."""

from __future__ import annotations

import torch

from ...precision import quant
from .harness import (
    Case,
    Failure,
    expect_tensor,
    expect_tuple,
    generator,
    run_check,
)

# The package's implementation with the exercise's signature (`checks.reference`)

def reference_quantize(x):
    """quant.mxfp8_quantize(x, rule="te")"""
    return quant.mxfp8_quantize(x, rule="te")


def _e4m3_value(code: int) -> float:
    return float(quant.decode_table(quant.E4M3)[code])


def _scale_diagnosis(amax: float, mine: int, want: int, where: str) -> str:
    """Why a block's scale byte is wrong, in one sentence."""
    e_mine, e_want = mine - 127, want - 127
    if amax == 0:
        return (f"{where} is all zeros: amax 0 gets scale byte 0 (2^-127) under TE's rule, yours "
                f"is {mine} - log2(0) is -inf, so handle amax == 0 and clamp E to [-127, 127]")
    if mine == e_want and mine != want:
        return (f"{where}'s scale byte is {mine}, the exponent E itself; E8M0 stores it biased: "
                f"E + 127 = {want}")
    if mine < want:
        return (f"{where}'s scale is 2^{e_mine} but its largest value {amax:g} needs 2^{e_want}: "
                f"{amax:g} / 2^{e_mine} = {amax / 2.0 ** e_mine:g} > 448 would saturate - round "
                "the exponent up (ceil), not down")
    return (f"{where}'s scale is 2^{e_mine} but 2^{e_want} is enough ({amax:g} / 2^{e_want} = "
            f"{amax / 2.0 ** e_want:g} ≤ 448): TE's rule takes the smallest power of two with "
            "amax / 2^E ≤ 448 (dividing by 256 or 512 instead of 448 is a common slip)")


def _code_diagnosis(x: float, scale_byte: int, mine: int, want: int, where: str) -> str:
    e = scale_byte - 127
    if mine == int(quant.fp8_encode(torch.tensor(x * 2.0 ** e))):
        return (f"{where} = {x:g} was multiplied by the scale: divide by 2^{e} before the cast "
                f"(it should be stored as {_e4m3_value(want):g}, code 0x{want:02X})")
    return (f"{where} = {x:g} should be stored as {x:g} / 2^{e} → E4M3 {_e4m3_value(want):g} "
            f"(code 0x{want:02X}); yours is {_e4m3_value(mine):g} (0x{mine:02X}): divide every "
            "element by the block's scale 2^E, then cast to float8_e4m3fn")


def _fp8_codes(data, shape, what: str) -> torch.Tensor:
    data = expect_tensor(data, what)
    if data.dtype != torch.float8_e4m3fn:
        raise Failure(f"{what} are {data.dtype}: return them as torch.float8_e4m3fn "
                      "((x / 2^E).to(torch.float8_e4m3fn))")
    if tuple(data.shape) != tuple(shape):
        raise Failure(f"{what} have shape {list(data.shape)}, expected {list(shape)} (the "
                      "input's shape; drop any padding)")
    return data.view(torch.uint8).long()


def _one_block_cases() -> list[Case]:
    """Single blocks where the scale rule goes wrong: the worked example first."""
    g = generator(107)

    def block(scale=1.0):
        return torch.randn(1, 32, generator=g) * scale

    worked = torch.rand(1, 32, generator=g) * 6 - 3
    worked[0, :3] = torch.tensor([480.0, -3.3, 0.01])
    edges = block(100).clamp(-400, 400).repeat(2, 1)
    edges[0, 7], edges[1, 20] = 448.0, 449.0
    negative = block(10)
    negative[0, 5] = -1000.0
    return [
        Case("the worked example: one block, largest value 480, also -3.3 and 0.01", (worked,)),
        Case("two blocks, largest values exactly 448 (scale 2^0 fits) and 449 (just needs 2^1)",
             (edges,)),
        Case("small values (amax ~ 1e-3: a negative exponent)", (block(3e-4),)),
        Case("a block whose largest magnitude is negative (-1000)", (negative,)),
        Case("an all-zero block", (torch.zeros(1, 32),)),
    ]


def _tensor_cases() -> list[Case]:
    g = generator(108)
    outlier = torch.randn(4, 96, generator=g)
    outlier[0, 40] = 1000.0
    zero_row = torch.randn(3, 64, generator=g)
    zero_row[1] = 0.0
    worked, *edges = _one_block_cases()  # the worked example first, then a random tensor
    return [
        worked,
        Case("4 rows × 64 values (2 blocks per row)", (torch.randn(4, 64, generator=g),)),
        *edges,
        Case("3 rows × 100 values (not a multiple of 32: the last block holds 4)",
             (torch.randn(3, 100, generator=g) * 5,)),
        Case("an outlier (1000) in row 0's second block", (outlier,)),
        Case("an all-zero row among random ones", (zero_row,)),
        Case("bf16 input, 2 rows × 96 values", ((torch.randn(2, 96, generator=g) * 50).bfloat16(),)),
        Case("5 rows × 33 values (a block of one value)", (torch.randn(5, 33, generator=g),)),
    ]


def _verify_tensor(case: Case, call) -> None:
    (x,) = case.args
    rows, n = x.shape
    blocks = -(-n // quant.MX_BLOCK)
    data, scales = expect_tuple(call(x), 2, "(data float8_e4m3fn, scales uint8)")
    scales = expect_tensor(scales, "your scales")
    ref_data, ref_scales = reference_quantize(x)
    if tuple(scales.shape) != (rows, blocks):
        if tuple(scales.shape) == (rows, n // quant.MX_BLOCK):
            raise Failure(f"{n} values per row need ceil({n}/32) = {blocks} blocks, your scales "
                          f"have {n // quant.MX_BLOCK}: pad the last block with zeros (zeros do "
                          "not change its amax)")
        if scales.numel() == 1:
            raise Failure("you computed one scale for the whole tensor: every block of 32 "
                          "consecutive values of a row gets its own scale")
        if scales.shape[-1] == n or scales.shape[0] != rows:
            raise Failure(f"your scales have shape {list(scales.shape)}: blocks run along the "
                          f"last dim (32 consecutive values of a row), so expect [rows, "
                          f"ceil(N/32)] = [{rows}, {blocks}]")
        raise Failure(f"your scales have shape {list(scales.shape)}, expected [rows, ceil(N/32)] "
                      f"= [{rows}, {blocks}]")
    if scales.is_floating_point():
        raise Failure(f"your scales are {scales.dtype}: return the E8M0 bytes (uint8, E + 127), "
                      "not the scale values 2^E")
    mine, want = scales.long(), ref_scales.long()
    if not torch.equal(mine, want):
        r, b = (int(v) for v in (mine != want).nonzero()[0])
        amax = x[r, b * 32:(b + 1) * 32].float().abs().max().item()
        per_tensor = int(quant.mx_scale_from_amax(x.float().abs().max()))
        if (mine == per_tensor).all() and want.unique().numel() > 1:
            raise Failure(f"every block got the same scale byte {int(mine[0, 0])}: each block of "
                          "32 values gets its own scale from its own amax (so an outlier only "
                          f"costs its own block; row {r}, block {b} needs byte {int(want[r, b])})")
        signed = x[r, b * 32:(b + 1) * 32].float().max().item()
        if signed < amax and int(mine[r, b]) == int(quant.mx_scale_from_amax(torch.tensor(signed))):
            raise Failure(f"row {r}, block {b}: your scale follows the largest value {signed:g}, "
                          f"but the largest magnitude is {amax:g}: take the amax of the absolute "
                          "values (.abs() before the max)")
        raise Failure(_scale_diagnosis(amax, int(mine[r, b]), int(want[r, b]),
                                       f"row {r}, block {b}"))
    data = expect_tensor(data, "your data")
    if data.dim() == 2 and data.shape[-1] == blocks * quant.MX_BLOCK != n:
        raise Failure(f"your data has {data.shape[-1]} columns, the input {n}: drop the zero "
                      "padding of the last block")
    codes = _fp8_codes(data, x.shape, "your data")
    ref_codes = ref_data.view(torch.uint8).long()
    if not torch.equal(codes, ref_codes):
        r, c = (int(v) for v in (codes != ref_codes).nonzero()[0])
        if x[r, c // 32 * 32:(c // 32 + 1) * 32].float().abs().max().item() == 0:
            raise Failure(f"row {r}, block {c // 32} is all zeros and must stay zeros (codes "
                          f"0x00), yours has 0x{int(codes[r, c]):02X}: an all-zero block has amax "
                          "0 - give it scale byte 0 (E = -127, clamped), never divide by 2^-inf "
                          "or by a zero scale (0 / 0 is NaN)")
        raise Failure(_code_diagnosis(x[r, c].float().item(), int(want[r, c // 32]),
                                      int(codes[r, c]), int(ref_codes[r, c]),
                                      f"row {r}, column {c}"))


def check_quantize(learner_fn) -> bool:
    """`quantize(x [rows, N]) -> (data float8_e4m3fn [rows, N], scales uint8 [rows, ceil(N/32)])`
    against `quant.mxfp8_quantize(x, rule="te")`."""
    return run_check("check_quantize", learner_fn, _tensor_cases(), _verify_tensor,
                     against="quant.mxfp8_quantize",
                     error_hints=(
                         ("-inf", "an all-zero block has amax 0: handle it (scale byte 0)"),
                         ("cannot convert float infinity", "an all-zero block has amax 0 and "
                          "log2(0) = -inf: handle it (scale byte 0)")))
