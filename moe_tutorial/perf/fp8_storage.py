"""How many bytes Transformer Engine 2.20.2 keeps per value of an FP8 tensor, by recipe and GPU
architecture: of a tensor quantized with the usages asked for, of a GEMM input saved for the
backward pass, and of a weight's FP8 copy. `memory` predicts a step's memory with these; each
rule cites the TE source it was read from.
"""

from __future__ import annotations

from ..precision import recipes
from ..precision.quant import MX_BLOCK

FP32 = 4  # bytes of one fp32 block scale


def fp8_bytes_per_value(recipe: str, arch: str, *, rowwise: bool, columnwise: bool,
                        weight: bool = False) -> float:
    """Bytes TE 2.20.2 stores per value of a tensor quantized under `recipe` on `arch`, holding
    the usages asked for: rowwise (what the forward GEMM reads) and columnwise (what the
    backward GEMMs read).

    Per-tensor recipes (DelayedScaling, Float8CurrentScaling): csrc/quantizer.cpp,
    `Float8Quantizer::create_tensor` and `Float8CurrentScalingQuantizer::create_tensor`, allocate
    `with_data = rowwise_usage || is_non_tn_fp8_gemm_supported` and `with_transpose =
    columnwise_usage && !is_non_tn_fp8_gemm_supported`; pytorch/utils.py,
    `is_non_tn_fp8_gemm_supported`, is true from compute capability 10.0 (Blackwell). So Hopper
    keeps a second, transposed copy for the columnwise use and Blackwell reads one copy both
    ways. (One fp32 scale per tensor: left out.)
    Float8BlockScaling: pytorch/tensor/float8_blockwise_tensor.py,
    `Float8BlockQuantizer.inner_tensor_specs`: a rowwise and a (transposed) columnwise copy,
    each with fp32 scales, one per 1×128 block of activations and per 128×128 block of weights
    (`get_scale_shape`; common/recipe/__init__.py, `Float8BlockScaling`: x_block_scaling_dim=1,
    w_block_scaling_dim=2).
    MXFP8BlockScaling: pytorch/tensor/mxfp8_tensor.py, `MXFP8Quantizer.inner_tensor_specs`: a
    rowwise and a columnwise copy, each with one uint8 (E8M0) scale per 32 values
    (constants.py, MXFP8_BLOCK_SCALING_SIZE = 32; quant.MX_BLOCK here)."""
    copies = int(rowwise) + int(columnwise)
    if recipe in ("DelayedScaling", "Float8CurrentScaling"):
        return 1.0 if arch == "blackwell" and copies else float(copies)
    if recipe == "Float8BlockScaling":
        block_values = 128 * 128 if weight else 128  # TE's block length is 128
        return copies * (1 + FP32 / block_values)
    if recipe == "MXFP8BlockScaling":
        return copies * (1 + 1 / MX_BLOCK)  # one byte of scale per block of 32
    raise ValueError(f"no FP8 storage rule for recipe {recipe!r}; choose one of "
                     f"{recipes.TE_RECIPES}")


def fp8_activation_bytes(recipe: str, arch: str) -> float:
    """Bytes per value of a GEMM input a TE module saves for the backward pass: only the
    columnwise copy, which the weight-gradient GEMM reads. TE 2.20.2:
    module/linear.py `_linear_forward_impl`, module/grouped_linear.py `_GroupedLinear.forward`
    and ops/basic/grouped_linear.py `GroupedLinear._fuser_forward_split_quantize` all call
    `update_usage(rowwise_usage=False, columnwise_usage=True)` on the input they save."""
    return fp8_bytes_per_value(recipe, arch, rowwise=False, columnwise=True)


def fp8_weight_copy_bytes(recipe: str, arch: str, module: str) -> float:
    """Bytes per weight value of the FP8 copy a TE module saves for the backward pass. Nothing
    in this model passes `is_first_microbatch`, so TE caches no copy between steps (module/
    grouped_linear.py, `GroupedLinear.forward`: `cache_weight = is_first_microbatch is not None`):
    every forward pass quantizes the weights and saves the copy until the layer's backward pass.

    module "grouped_linear" (te.GroupedLinear) and "linear" (te.Linear): the copy is quantized
    with rowwise and columnwise usage and saved as it is (module/grouped_linear.py,
    `_GroupedLinear.forward`, `prepare_for_saving(*inputmats, *weights_fp8, ...)`; module/
    linear.py, `wt_save = weightmat`). module "ops" (te.ops.GroupedLinear): the saved copy keeps
    only the columnwise data (ops/basic/grouped_linear.py, `_fuser_forward_split_quantize`:
    `w.update_usage(rowwise_usage=False, columnwise_usage=True)`). That is the split-quantize
    path, the one TE takes for DelayedScaling always and, on Hopper, for FP8 current scaling with
    cuBLASLt older than 13.5 and for block scaling older than 13.6 (cuBLASLt 13.0 of CUDA 13.0,
    the course's bundle: `is_op_fuser_grouped_tensor_path_supported`, ops/basic/grouped_linear.py:
    74-132 in TE 2.20.2; MXFP8 and NVFP4 take the grouped path on Blackwell with cuBLASLt >= 13.3);
    the grouped-tensor path keeps both copies, as te.GroupedLinear does."""
    both = module in ("grouped_linear", "linear")
    return fp8_bytes_per_value(recipe, arch, rowwise=both, columnwise=True, weight=True)
