"""Transformer Engine's quantizers against moe_tutorial.precision.quant, byte for byte (CUDA + TE).

Run on the GPU machine, from the project root (prints one summary line per comparison):

    source .gpu/setup.sh && python3 -m pytest -m gpu tests/precision/test_quant_te.py -v -rs

* MXFP8: TE's `MXFP8Quantizer` (rowwise and columnwise, compact scale layout) against
  ``mxfp8_quantize(..., rule="te")`` on random and adversarial inputs, in bf16 and fp32.
  TE 2.20 compiles the body of its MXFP8 quantize kernels for compute capability >= 10.0 only
  (``#if __CUDA_ARCH__ >= 1000`` in common/cast/mxfp8/quantize_mxfp8.cuh; TE's own C++ test
  skips pre-Blackwell GPUs): on Hopper the launch succeeds and writes nothing. The test fills
  TE's output buffers with two different sentinels and skips, saying so, when they come back
  untouched, rather than comparing uninitialised memory.
* FP8: TE's `Float8Quantizer` (a fixed scale: the raw E4M3/E5M2 cast) and
  `Float8CurrentScalingQuantizer` against `fp8_encode` / `per_tensor_quantize`; these kernels
  run on Hopper and Blackwell alike.
"""

from types import SimpleNamespace

import pytest
import torch

from moe_tutorial.precision import quant


def _load_te():
    """TE's pieces, or None and the reason they are missing."""
    if not torch.cuda.is_available():
        return None, "needs a CUDA GPU"
    try:
        import transformer_engine.pytorch  # noqa: F401  (loads TE's PyTorch extension)
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import (
            Float8CurrentScalingQuantizer,
            Float8Quantizer,
        )
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: TE found no CUDA/cuDNN
        return None, f"needs Transformer Engine ({type(exc).__name__}: {exc})"
    return SimpleNamespace(tex=tex, MXFP8Quantizer=MXFP8Quantizer, Float8Quantizer=Float8Quantizer,
                           Float8CurrentScalingQuantizer=Float8CurrentScalingQuantizer), None


TE, WHY_NOT = _load_te()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(TE is None, reason=f"{WHY_NOT}")]

BLOCK = 32
SHAPES = [(128, 256), (256, 4096), (992, 96), (32, 32), (64, 2048)]  # TE: both dims % 32 == 0
DTYPES = [torch.bfloat16, torch.float32]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _te_fp8_dtype(fmt):
    return TE.tex.DType.kFloat8E4M3 if fmt is quant.E4M3 else TE.tex.DType.kFloat8E5M2


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _planted(rows, cols, magnitudes, noise, generator):
    """Small noise with one planted value per 32-block in *both* directions: row r holds its
    value at column 32·b + r % 32, so every rowwise block and every columnwise block (32 rows
    of one column) contains exactly one. The planted values cycle through `magnitudes` with
    alternating signs; the noise is `noise` × the planted value's magnitude."""
    values = torch.tensor(magnitudes, dtype=torch.float64)
    x = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    r = torch.arange(rows).unsqueeze(1)
    block = torch.arange(cols // BLOCK).unsqueeze(0)
    pick = (r * (cols // BLOCK) + block) % len(values)
    sign = torch.where((r + block) % 2 == 0, 1.0, -1.0)
    planted = values[pick] * sign
    x = x.view(rows, cols // BLOCK, BLOCK) * (planted.abs() * noise).unsqueeze(-1)
    x[r, block, r % BLOCK] = planted
    return x.view(rows, cols)


def adversarial_inputs(rows, cols, dtype, seed=0):
    """label -> 2-D CPU tensor in `dtype`."""
    g = torch.Generator().manual_seed(seed)

    def neighbours(values):
        """Each value and the next representable values above and below it in `dtype`."""
        v = torch.tensor(values, dtype=dtype)
        up = torch.nextafter(v, torch.full_like(v, float("inf")))
        down = torch.nextafter(v, torch.zeros_like(v))
        return torch.cat([v, up, down]).double().tolist()

    normal = torch.randn(rows, cols, generator=g)
    outliers = normal.clone()
    spots = torch.randint(0, rows * cols, (max(rows * cols // 500, 4),), generator=g)
    outliers.view(-1)[spots] *= 1e4
    outliers.view(-1)[spots[:3]] = torch.tensor([1e30, -3e30, 2e29])
    zero_blocks = torch.randn(rows, cols, generator=g)
    zero_blocks.view(rows, cols // BLOCK, BLOCK)[:, ::3] = 0.0  # rowwise all-zero blocks
    zero_blocks[: min(rows, 2 * BLOCK): 2] = 0.0  # and columnwise blocks that are half zeros
    if rows >= 2 * BLOCK:
        zero_blocks[BLOCK: 2 * BLOCK] = 0.0  # columnwise all-zero blocks
    wide = torch.randn(rows, cols, generator=g) * torch.exp2(torch.rand(rows, cols, generator=g) * 80 - 40)
    inputs = {
        "normal": normal,
        "outliers": outliers,
        "zero_blocks": zero_blocks,
        # block maxima at 448 × 2^k and one step above/below: the scale-rule boundary
        "around_448": _planted(rows, cols, neighbours([448.0 * 2.0 ** k for k in range(-30, 31)]),
                               1e-2, g),
        # block maxima down to float32 subnormals: scale bytes near 0, E4M3 subnormal elements
        "tiny": _planted(rows, cols, neighbours([2.0 ** k for k in range(-140, -99, 3)]), 0.3, g),
        "powers_of_two": _planted(rows, cols, neighbours([2.0 ** k for k in range(-20, 21)]), 0.4, g),
        # 80 binades inside one block: many values become E4M3 subnormals or zero
        "wide_range": wide,
    }
    return {label: x.to(dtype) for label, x in inputs.items()}


# ---------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------

BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")
SENTINELS = (0x5A, 0xA5)


def te_mxfp8(x: torch.Tensor):
    """TE's MXFP8 of a 2-D CUDA tensor: {"rowwise": (data [M, N], scales [M, N/32]),
    "columnwise": (data [M, N], scales [M/32, N])} as uint8 CPU tensors with the scale padding
    removed; None when the kernel wrote nothing at all."""
    rows, cols = x.shape
    quantizer = TE.MXFP8Quantizer(fp8_dtype=TE.tex.DType.kFloat8E4M3, rowwise=True,
                                  columnwise=True)
    quantizer.optimize_for_gemm = False  # compact row-major scales, not cuBLAS's swizzled layout
    runs = []
    for sentinel in SENTINELS:
        out = quantizer.make_empty(x.shape, dtype=x.dtype, device=x.device)
        assert not getattr(out, "_with_gemm_swizzled_scales", False), (
            "TE produced GEMM-swizzled scales although optimize_for_gemm=False was asked for")
        for name in BUFFERS:
            buffer = getattr(out, name)
            assert buffer is not None, f"MXFP8 tensor has no {name} (rowwise and columnwise asked)"
            buffer.fill_(sentinel)
        quantizer.update_quantized(x, out)
        torch.cuda.synchronize()
        runs.append({name: getattr(out, name).view(torch.uint8).cpu() for name in BUFFERS})

    # Compact layout: scales padded to [round_up(M, 128), round_up(N/32, 4)] rowwise and
    # [round_up(M/32, 4), round_up(N, 128)] columnwise (MXFP8Quantizer.get_scale_shape).
    expected_shapes = {
        "_rowwise_data": (rows, cols), "_columnwise_data": (rows, cols),
        "_rowwise_scale_inv": (_round_up(rows, 128), _round_up(cols // BLOCK, 4)),
        "_columnwise_scale_inv": (_round_up(rows // BLOCK, 4), _round_up(cols, 128)),
    }
    for name, shape in expected_shapes.items():
        assert tuple(runs[0][name].shape) == shape, (
            f"TE's {name} has shape {tuple(runs[0][name].shape)}, expected {shape} for input "
            f"{tuple(x.shape)}: the scale layout changed, update the un-padding below")
    unpadded = {"_rowwise_data": (slice(None), slice(None)),
                "_columnwise_data": (slice(None), slice(None)),
                "_rowwise_scale_inv": (slice(0, rows), slice(0, cols // BLOCK)),
                "_columnwise_scale_inv": (slice(0, rows // BLOCK), slice(0, cols))}
    first = {name: runs[0][name][unpadded[name]] for name in BUFFERS}
    unwritten = {name: int((first[name] != runs[1][name][unpadded[name]]).sum()) for name in BUFFERS}
    if all(unwritten[name] == first[name].numel() for name in BUFFERS):
        return None
    assert not any(unwritten.values()), (
        f"TE's MXFP8 kernel left some output bytes unwritten (count per buffer: {unwritten}) "
        f"for a {x.dtype} input of shape {tuple(x.shape)}")
    return {"rowwise": (first["_rowwise_data"], first["_rowwise_scale_inv"]),
            "columnwise": (first["_columnwise_data"], first["_columnwise_scale_inv"])}


def _describe(label, direction, kind, ours, theirs, x):
    """A few mismatching positions, with the input values, for the assertion message."""
    if ours.shape != theirs.shape:
        return f"{label} {direction} {kind}: shape {tuple(ours.shape)} vs TE {tuple(theirs.shape)}"
    where = (ours != theirs).nonzero()[:3].tolist()
    return (f"{label} {direction} {kind}: {int((ours != theirs).sum())} of {ours.numel()} differ; "
            + "; ".join(f"at {tuple(i)} ours={int(ours[tuple(i)])} TE={int(theirs[tuple(i)])}"
                        + (f" x={x[tuple(i)].item()!r}" if kind == "data" else "")
                        for i in where))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mxfp8_quantizer_bytes_and_scales_equal_ours(dtype, capsys):
    failures, cases, elements, scales = [], 0, 0, 0
    for rows, cols in SHAPES:
        for kind, x in adversarial_inputs(rows, cols, dtype, seed=rows + cols).items():
            theirs = te_mxfp8(x.cuda())
            if theirs is None:
                major, minor = torch.cuda.get_device_capability()
                pytest.skip(f"TE's MXFP8 quantize kernel wrote nothing on this "
                            f"{torch.cuda.get_device_name()} (sm_{major}{minor}): TE compiles it "
                            "for compute capability >= 10.0 only, so there is nothing to compare")
            label = f"{kind} {rows}x{cols} {dtype}"
            for direction, dim in (("rowwise", -1), ("columnwise", 0)):
                our_data, our_scales = quant.mxfp8_quantize(x.float(), dim=dim, rule="te")
                te_data, te_scales = theirs[direction]
                our_data = our_data.view(torch.uint8)
                if not torch.equal(our_scales, te_scales):
                    failures.append(_describe(label, direction, "scales", our_scales, te_scales, x))
                if not torch.equal(our_data, te_data):
                    failures.append(_describe(label, direction, "data", our_data, te_data, x))
                elements += x.numel()
                scales += our_scales.numel()
            cases += 1
    with capsys.disabled():
        print(f"\nMXFP8 TE vs moe_tutorial.precision.quant ({dtype}, {torch.cuda.get_device_name()}): "
              f"{cases} cases ({len(SHAPES)} shapes x {cases // len(SHAPES)} inputs), "
              f"{elements} elements and {scales} scales compared rowwise+columnwise, "
              f"{len(failures)} mismatching tensors")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# FP8 per-tensor
# ---------------------------------------------------------------------------------------------

def _cast_grid(fmt):
    """Every finite FP8 value, the midpoints (ties), overflow, infinities, NaN, random values."""
    table = quant.decode_table(fmt)
    finite = table[torch.isfinite(table)]
    positive = torch.unique(finite.abs().double())
    midpoints = ((positive[1:] + positive[:-1]) / 2).float()
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([464.0, 465.0, 480.0, 61440.0, 1e30, float("inf"), float("nan")])
    random = torch.exp2(torch.rand(20_000, generator=g) * 50 - 25) * torch.randn(20_000, generator=g)
    values = torch.cat([finite, midpoints, specials, random])
    values = torch.cat([values, -values])
    return torch.nn.functional.pad(values, (0, -values.numel() % 16)).view(-1, 16)


def _differing_codes(ours, theirs, fmt):
    """Where the codes differ, counting any NaN code as equal to any other (on the H200 TE's NaN
    code did not keep the input's sign; ours does, as torch's cast does)."""
    both_nan = quant.fp8_decode(ours, fmt).isnan() & quant.fp8_decode(theirs, fmt).isnan()
    return (ours != theirs) & ~both_nan


@pytest.mark.parametrize("fmt", [quant.E4M3, quant.E5M2], ids=lambda f: f.name)
def test_fp8_cast_equals_ours(fmt, capsys):
    x = _cast_grid(fmt)
    quantizer = TE.Float8Quantizer(scale=torch.ones(1, device="cuda"),
                                   amax=torch.zeros(1, device="cuda"),
                                   fp8_dtype=_te_fp8_dtype(fmt), rowwise=True, columnwise=False)
    with torch.no_grad():
        theirs = quantizer(x.cuda())._data.view(torch.uint8).cpu()
    ours = quant.fp8_encode(x, fmt)
    differ = _differing_codes(ours, theirs, fmt)
    with capsys.disabled():
        print(f"\nFP8 {fmt.name} cast TE vs moe_tutorial.precision.quant: {x.numel()} values (all codes, "
              f"ties, overflow, inf, NaN), {int(differ.sum())} differ")
    assert not differ.any(), (
        f"{int(differ.sum())} differ, e.g. x={x[differ][:5].tolist()} "
        f"ours={ours[differ][:5].tolist()} TE={theirs[differ][:5].tolist()}")


@pytest.mark.parametrize("fmt", [quant.E4M3, quant.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_current_scaling_equals_ours(fmt, dtype, capsys):
    tensors, compared = 0, 0
    for rows, cols in SHAPES:
        for kind, x in adversarial_inputs(rows, cols, dtype, seed=rows * cols).items():
            quantizer = TE.Float8CurrentScalingQuantizer(
                fp8_dtype=_te_fp8_dtype(fmt), device=torch.device("cuda"), rowwise=True,
                columnwise=False)
            with torch.no_grad():
                out = quantizer(x.cuda())
            te_data, te_scale_inv = out._data.view(torch.uint8).cpu(), out._scale_inv.cpu()
            data, scale_inv = quant.per_tensor_quantize(x.float(), fmt)
            assert te_scale_inv.item() == scale_inv.item(), (
                f"{kind} {rows}x{cols} {dtype} {fmt.name}: scale_inv TE={te_scale_inv.item()!r} "
                f"ours={scale_inv.item()!r} (amax {x.float().abs().max().item()!r})")
            ours = data.view(torch.uint8)
            differ = ours != te_data
            assert not differ.any(), (
                f"{kind} {rows}x{cols} {dtype} {fmt.name}: {int(differ.sum())} bytes differ, e.g. "
                f"x={x[differ][:5].tolist()} ours={ours[differ][:5].tolist()} "
                f"TE={te_data[differ][:5].tolist()}")
            tensors, compared = tensors + 1, compared + x.numel()
    with capsys.disabled():
        print(f"\nFP8 {fmt.name} current scaling TE vs moe_tutorial.precision.quant ({dtype}): "
              f"{tensors} tensors, {compared} elements, all equal")
