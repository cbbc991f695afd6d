"""What the chapter measures of a quantization: how far a result is from its reference
(`rel_error`, the course's one measure), what each method loses on a tensor
(`quantization_error`, `error_table`), where a tensor's magnitudes sit against E4M3's range
(`dynamic_range_histogram`), and the bytes each format stores (`bytes_per_element`,
`moe_activation_memory`).
"""

from __future__ import annotations

import math

import torch

from .blocks import (
    MX_BLOCK,
    _check_block,
    e8m0_to_float,
    mxfp8_dequantize,
    mxfp8_quantize,
    tile_fake_quantize,
)
from .formats import (
    E4M3,
    _check_quantizable,
    _nan_ignoring_amax,
    current_scale,
    per_tensor_dequantize,
    per_tensor_quantize,
)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius norms, in fp32): how far an output or a gradient is
    from its reference — the measure every notebook, check and benchmark of the course quotes."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()



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
