"""Backends `sync_free`, `sync_free_fp8`, `sync_free_fp8_wgrad`: expert GEMMs the host never
waits for, so that a whole training step (forward, backward, clipping, AdamW) can be captured
once in a CUDA graph and replayed (`train.graphed.GraphedTrainStep`).

Where the other expert paths wait for the GPU: `routing.permute` sizes its row buffer from the
routing (`int(m_splits.sum())`), and TE's `GroupedLinear` splits its input with a Python list
of row counts (`split_sizes.tolist()`). Each such read makes the host wait until the GPU has
computed the counts; the kernels queued after it start only once the host has launched them,
so every wait shows as idle GPU time, and a step with such a read cannot be captured in a CUDA
graph (capture refuses a host read).

These backends ask the dispatcher for `routing.permute_static` (`permutation = "static"`: a
buffer sized by the shapes alone, the unused rows zero and the last expert's) and run GEMMs that
take the row offsets as a device tensor: `torch._grouped_mm` (bf16), and for FP8 on Hopper
`torch._scaled_grouped_mm` with row-wise scales (`ScaledGroupedLinear`): the forward GEMM and
the input-gradient GEMM in FP8 (E4M3); the weight-gradient GEMM, whose contraction runs over
each expert's rows, in bf16 (`torch._grouped_mm`), or with `fp8_weight_gradient` in FP8 with a
scale per expert and column (`quantize_columns_per_expert`). Without the FP8 kernel (a CPU, a
GPU before Hopper, the meta device) the same quantized operands are multiplied after
dequantizing them, and `last_path` says so. The detectors that prove no host read is left are
in `perf.host_syncs`.
"""

from __future__ import annotations

import functools

import torch

from .base import StackedExperts, swiglu
from .grouped_torch import grouped_mm_unusable

# Rows per expert for the FP8 GEMMs: 16 rows of E4M3 are 16 bytes, so in the weight-gradient
# GEMM, whose operands are transposed and contract over the rows, every expert's slice starts
# 16-byte aligned (the alignment the grouped GEMMs' strides are checked against)
FP8_ROW_ALIGNMENT = 16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Rows (or weight rows) whose largest magnitude is below this are scaled as if it were this:
# an all-zero row (the buffer's unused rows) quantizes to zeros instead of dividing by zero
AMAX_FLOOR = 1e-12


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows `[offsets[e-1], offsets[e])` of x [R, K] times w[e]^T ([E, N, K] weights) for every
    expert, through `torch._grouped_mm` (differentiable; its backward takes the same offsets).
    Refuses, in one line, tensors the op cannot take rather than reading the offsets to loop."""
    reason = grouped_mm_unusable(x, w)
    if reason is not None:
        raise ValueError(f"the sync-free experts need torch._grouped_mm, which cannot run here: "
                         f"{reason}")
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of `t` with one scale per row (over the last dimension): (q, dequantization
    scale), q * scale[..., None] ≈ t. The scale maps each row's largest magnitude to E4M3's
    largest finite value (448)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=AMAX_FLOOR)
    scale = FP8_MAX / amax
    q = (t.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reciprocal().squeeze(-1)


@functools.cache
def _compiled_quantize_rowwise():
    # One generated kernel per shape instead of six elementwise passes and a reduction; the
    # step's shapes are static, so each compiles once. Detached inputs: the quantized values
    # need no gradient, and one traced graph serves a tensor whether it requires one or not.
    compiled = torch.compile(quantize_rowwise, dynamic=False)
    return lambda t: compiled(t.detach())


def scaled_gemm_path(device: torch.device) -> str:
    """Which FP8 GEMM `ScaledGroupedLinear` runs on `device`: torch's row-wise scaled grouped
    GEMM where there is one (CUDA, compute capability 9.x: Hopper's kernel), else the emulation
    (the quantized operands dequantized, then `torch._grouped_mm`)."""
    if (device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] == 9):
        return "torch._scaled_grouped_mm"
    return "emulated FP8 (dequantized operands, torch._grouped_mm)"


def _scaled_grouped_mm(a_q, a_scale, b_q, b_scale, offsets, out_dtype):
    """out[rows of e] = (a_q * a_scale) @ (b_q[e] * b_scale[e])^T: a_q [R, K] E4M3 row-major with
    one scale per row, b_q [E, N, K] E4M3 with one scale per (expert, row)."""
    if scaled_gemm_path(a_q.device) == "torch._scaled_grouped_mm":
        # The kernel takes b column-major: [E, K, N] as a transposed view of [E, N, K]
        return torch._scaled_grouped_mm(a_q, b_q.transpose(-2, -1), a_scale, b_scale,
                                        offs=offsets, out_dtype=out_dtype)
    a = (a_q.float() * a_scale.unsqueeze(-1)).to(out_dtype)
    b = (b_q.float() * b_scale.unsqueeze(-1)).to(out_dtype)
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)


def quantize_columns_per_expert(t: torch.Tensor, offsets: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of t [R, C] with one scale per (expert, column), over that expert's rows
    (`offsets`: the experts' row ends), returned transposed, row-major: (q [C, R], dequantization
    scales [E·C], expert-major), the operand layout of the weight-gradient GEMM, whose ragged
    dimension is the rows. No host read: each row's expert comes from `searchsorted`."""
    num_experts, num_rows = offsets.numel(), t.shape[0]
    rows = torch.arange(num_rows, device=t.device, dtype=offsets.dtype)
    expert_of_row = torch.searchsorted(offsets, rows, right=True).clamp_(max=num_experts - 1)
    magnitude = t.abs().float()
    amax = magnitude.new_zeros(num_experts, t.shape[1]).index_reduce_(0, expert_of_row, magnitude,
                                                                       "amax")
    scale = FP8_MAX / amax.clamp(min=AMAX_FLOOR)
    q = (t.float() * scale[expert_of_row]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.t().contiguous(), scale.reciprocal().reshape(-1)


def _scaled_weight_gradient(grad_out: torch.Tensor, x: torch.Tensor,
                            offsets: torch.Tensor) -> torch.Tensor:
    """dW[e] = dy[rows of e]^T x[rows of e] [E, N, K] with FP8 operands scaled per (expert,
    column): the 2-D × 2-D form of the scaled grouped GEMM (ragged rows)."""
    g_q, g_scale = quantize_columns_per_expert(grad_out, offsets)  # [N, R]
    x_q, x_scale = quantize_columns_per_expert(x, offsets)  # [K, R]
    if scaled_gemm_path(x.device) == "torch._scaled_grouped_mm":
        return torch._scaled_grouped_mm(g_q, x_q.t(), g_scale, x_scale, offs=offsets,
                                        out_dtype=x.dtype)
    num_experts, num_rows = offsets.numel(), x.shape[0]
    rows = torch.arange(num_rows, device=x.device, dtype=offsets.dtype)
    expert_of_row = torch.searchsorted(offsets, rows, right=True).clamp_(max=num_experts - 1)
    g = g_q.float() * g_scale.view(num_experts, -1)[expert_of_row].t()
    xs = x_q.float() * x_scale.view(num_experts, -1)[expert_of_row].t()
    return torch._grouped_mm(g.to(x.dtype), xs.t().to(x.dtype), offs=offsets)


class ScaledGroupedLinear(torch.autograd.Function):
    """`grouped_linear` with FP8 (E4M3) operands and row-wise scales: forward y = x w^T and the
    input gradient dy w in FP8; the weight gradient dy^T x in the input dtype, or with
    `fp8_weight_gradient` in FP8 too (scales per expert and column,
    `quantize_columns_per_expert`). Saves x and w as they are (no FP8 copies outlive the
    forward pass)."""

    @staticmethod
    def forward(ctx, x, w, offsets, quantize, fp8_weight_gradient=False):
        ctx.save_for_backward(x, w, offsets)
        ctx.quantize, ctx.fp8_weight_gradient = quantize, fp8_weight_gradient
        x_q, x_scale = quantize(x)
        w_q, w_scale = quantize(w)  # one scale per (expert, output feature), over the inputs
        return _scaled_grouped_mm(x_q, x_scale, w_q, w_scale, offsets, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, w, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_q, g_scale = ctx.quantize(grad_out)
            # dx = dy w: w^T [E, K, N] in rows, one scale per (expert, input feature)
            wt_q, wt_scale = ctx.quantize(w.transpose(-2, -1).contiguous())
            grad_x = _scaled_grouped_mm(g_q, g_scale, wt_q, wt_scale, offsets, x.dtype)
        if ctx.needs_input_grad[1] and ctx.fp8_weight_gradient:
            grad_w = _scaled_weight_gradient(grad_out, x, offsets)
        elif ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(grad_out.t(), x, offs=offsets)  # [E, N, K]
        return grad_x, grad_w, None, None, None


def scaled_grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                          fp8_weight_gradient: bool = False) -> torch.Tensor:
    """`grouped_linear` in FP8 (`ScaledGroupedLinear`); every expert's row count must be a
    multiple of `FP8_ROW_ALIGNMENT` (`permute_static(..., align=FP8_ROW_ALIGNMENT)` builds them)."""
    reason = grouped_mm_unusable(x, w)
    if reason is not None:
        raise ValueError(f"the sync-free FP8 experts need torch._grouped_mm for the weight "
                         f"gradient, which cannot run here: {reason}")
    quantize = _compiled_quantize_rowwise() if x.is_cuda else quantize_rowwise
    return ScaledGroupedLinear.apply(x, w, offsets, quantize, fp8_weight_gradient)


class SyncFreeExperts(StackedExperts):
    """The stacked experts with no host read: two grouped GEMMs with device offsets (`fp8`:
    `scaled_grouped_linear`, its weight gradient in FP8 too with `fp8_weight_gradient`), SwiGLU
    between them. Registered three times: `sync_free` (bf16), `sync_free_fp8` and
    `sync_free_fp8_wgrad`; the FP8 ones quantize their own GEMMs in a bf16 model (no TE
    autocast around them: `registry.SELF_QUANTIZING_BACKENDS`)."""

    permutation = "static"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 dtype=None, device=None, fp8: bool = False, fp8_weight_gradient: bool = False):
        super().__init__(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
        if fp8_weight_gradient and not fp8:
            raise ValueError("fp8_weight_gradient=True needs fp8=True (the FP8 forward GEMMs)")
        self.fp8, self.fp8_weight_gradient = fp8, fp8_weight_gradient
        self.backend = ("sync_free_fp8_wgrad" if fp8_weight_gradient else
                        "sync_free_fp8" if fp8 else "sync_free")

    def rows_alignment(self, recipe) -> int:
        return FP8_ROW_ALIGNMENT if self.fp8 else 1

    def forward(self, rows: torch.Tensor, rows_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        self.check_rows(rows, rows_per_expert)
        offsets = torch.cumsum(rows_per_expert, 0).to(torch.int32)
        if self.fp8:
            def gemm(x, w, offs):
                return scaled_grouped_linear(x, w, offs, self.fp8_weight_gradient)
        else:
            gemm = grouped_linear
        h = gemm(rows, self.gate_up_proj, offsets)
        y = gemm(swiglu(h), self.down_proj, offsets)
        path = scaled_gemm_path(rows.device) if self.fp8 else "torch._grouped_mm"
        wgrad = (" (weight gradient FP8)" if self.fp8_weight_gradient else
                 " (weight gradient bf16)" if self.fp8 else "")
        self.last_path = f"{path} → SwiGLU → {path}{wgrad}"
        return y
