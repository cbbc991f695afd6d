"""A training step the host never waits for: routing, permutation and expert GEMMs whose shapes
do not depend on the routing, so the whole step (forward, backward, clipping, AdamW) can be
captured once in a CUDA graph and replayed.

Where the other expert paths wait for the GPU
---------------------------------------------
`routing.permute` sizes its row buffer from the routing (`int(m_splits.sum())`), and TE's
`GroupedLinear` splits its input with a Python list of row counts (`split_sizes.tolist()`). Each
such read makes the host wait until the GPU has computed the counts; the kernels queued after it
start only once the host has launched them, so every wait shows as idle GPU time, and a step
with such a read cannot be captured in a CUDA graph (capture refuses a host read).

What this module does instead
-----------------------------
* `permute_static`: the token copies sorted by expert into a buffer whose row count is fixed by
  the shapes alone, `static_rows(T, k, E, align)`: T·k rows, plus room for every expert's
  alignment padding (E·(align-1), rounded up) where the GEMMs need each expert's rows to be a
  multiple of `align`. The per-expert counts and row offsets stay on the device (`index_add_`
  counts, cumulative sums); the rows no token uses are zero and belong to the last expert, so the
  GEMMs read them as zero rows, and their outputs and gradients are zero.
* Expert GEMMs that take the offsets as a device tensor: `torch._grouped_mm` (bf16), and for FP8
  on Hopper `torch._scaled_grouped_mm` with row-wise scales (`ScaledGroupedLinear`): the
  forward GEMM and the input-gradient GEMM in FP8 (E4M3); the weight-gradient GEMM, whose
  contraction runs over each expert's rows, in bf16 (`torch._grouped_mm`), or with
  `fp8_weight_gradient` in FP8 with a scale per expert and column
  (`quantize_columns_per_expert`). Without the FP8 kernel (a CPU, a GPU before Hopper, the meta
  device) the same quantized operands are multiplied after dequantizing them, and `last_path`
  says so.

The whole step in one CUDA graph is `train.graphed.GraphedTrainStep`; the detectors that prove
no host read is left are in `perf.host_syncs`. The three backends (`sync_free`,
`sync_free_fp8`, `sync_free_fp8_wgrad`) register themselves in `experts.BACKENDS` when this
module is imported (`moe/__init__.py` imports it).
"""

from __future__ import annotations

import functools

import torch

from . import experts
from .experts import _grouped_mm_unusable, swiglu
from .routing import Permutation, _Dispatch, padded_rows, unpermute

# Rows per expert for the FP8 GEMMs: 16 rows of E4M3 are 16 bytes, so in the weight-gradient
# GEMM, whose operands are transposed and contract over the rows, every expert's slice starts
# 16-byte aligned (the alignment the grouped GEMMs' strides are checked against)
FP8_ROW_ALIGNMENT = 16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Rows (or weight rows) whose largest magnitude is below this are scaled as if it were this:
# an all-zero row (the buffer's unused rows) quantizes to zeros instead of dividing by zero
AMAX_FLOOR = 1e-12


def static_rows(num_tokens: int, top_k: int, num_experts: int, align: int = 1) -> int:
    """Rows of `permute_static`'s buffer: T·k token copies, and where each expert's rows are
    padded to a multiple of `align`, room for the most padding any routing can need
    (E·(align-1)), rounded up to a multiple of `align`. Shapes only: no routing is read."""
    copies = num_tokens * top_k
    if align == 1:
        return copies
    return -(-(copies + num_experts * (align - 1)) // align) * align


def permute_static(hidden: torch.Tensor, indices: torch.Tensor, num_experts: int,
                   align: int = 1) -> tuple[torch.Tensor, Permutation]:
    """`routing.permute` without a host read: the token copies sorted by expert (stable) into a
    buffer of `static_rows(T, k, E, align)` rows, each expert's block starting at a multiple of
    `align`. Returns (rows [R, H], the `Permutation` that `routing.unpermute` inverts).

    The permutation's `m_splits` are the padded rows per expert with the buffer's unused tail
    added to the last expert, so `perm.offsets` (the GEMMs' row ends) end at R: every row of the
    buffer belongs to an expert, the unused ones are zero rows."""
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align={align!r} must be a positive whole number of rows "
                         f"(1 = no padding)")
    num_tokens, top_k = indices.shape
    flat = indices.reshape(-1).long()  # index_add_ takes int64 indices
    order = torch.argsort(flat, stable=True)
    # index_add_ of ones counts without reading the indices' range (bincount reads it: a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = padded_rows(counts, align)
    num_rows = static_rows(num_tokens, top_k, num_experts, align)
    # The unused tail goes to the last expert: a multiple of `align` (both sums are)
    m_splits = torch.cat([padded[:-1], padded[-1:] + (num_rows - padded.sum())])
    sorted_experts = flat[order]
    real_starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - real_starts[sorted_experts]
    row_index = padded_starts[sorted_experts] + rank_in_expert
    assignment_rows = torch.empty_like(row_index).scatter_(0, order, row_index)
    perm = Permutation(order // top_k, row_index, assignment_rows.view(num_tokens, top_k),
                       counts, m_splits, num_rows, align)
    return _Dispatch.apply(hidden, perm), perm


# ---------------------------------------------------------------------------------------------
# Expert GEMMs with the offsets on the device

def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows `[offsets[e-1], offsets[e])` of x [R, K] times w[e]^T ([E, N, K] weights) for every
    expert, through `torch._grouped_mm` (differentiable; its backward takes the same offsets).
    Refuses, in one line, tensors the op cannot take rather than reading the offsets to loop."""
    reason = _grouped_mm_unusable(x, w)
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
    reason = _grouped_mm_unusable(x, w)
    if reason is not None:
        raise ValueError(f"the sync-free FP8 experts need torch._grouped_mm for the weight "
                         f"gradient, which cannot run here: {reason}")
    quantize = _compiled_quantize_rowwise() if x.is_cuda else quantize_rowwise
    return ScaledGroupedLinear.apply(x, w, offsets, quantize, fp8_weight_gradient)


def sync_free_experts(experts, hidden: torch.Tensor, indices: torch.Tensor,
                      weights: torch.Tensor, *, fp8: bool = False,
                      fp8_weight_gradient: bool = False) -> torch.Tensor:
    """The experts of `ExpertMLP` with no host read: `permute_static`, two grouped GEMMs with
    device offsets (`fp8`: `scaled_grouped_linear`, its weight gradient in FP8 too with
    `fp8_weight_gradient`), SwiGLU between them, `routing.unpermute` applying the routing
    weights."""
    align = FP8_ROW_ALIGNMENT if fp8 else 1
    rows, perm = permute_static(hidden, indices, experts.num_experts, align)
    offsets = perm.offsets
    if fp8:
        def gemm(x, w, offs):
            return scaled_grouped_linear(x, w, offs, fp8_weight_gradient)
    else:
        gemm = grouped_linear
    h = gemm(rows, experts.gate_up_proj, offsets)
    y = gemm(swiglu(h), experts.down_proj, offsets)
    path = scaled_gemm_path(hidden.device) if fp8 else "torch._grouped_mm"
    wgrad = (" (weight gradient FP8)" if fp8_weight_gradient else " (weight gradient bf16)"
             if fp8 else "")
    experts.last_path = (f"permute_static ({perm.num_rows} rows, align {align}) → {path} → "
                         f"SwiGLU → {path}{wgrad}")
    return unpermute(y, perm, weights)


def _backend(**options):
    def run(experts_module, hidden, indices, weights):
        return sync_free_experts(experts_module, hidden, indices, weights, **options)
    return run


experts.BACKENDS.update(sync_free=_backend(), sync_free_fp8=_backend(fp8=True),
                        sync_free_fp8_wgrad=_backend(fp8=True, fp8_weight_gradient=True))
