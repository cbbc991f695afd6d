"""Backend `grouped_torch`: the whole expert layer as two grouped GEMMs, in plain PyTorch.

The dispatcher has sorted the token copies by expert once (`routing.permute`), so one grouped
GEMM per projection runs all experts at once (`torch._grouped_mm`, given each expert's row end),
with SwiGLU between them; the dispatcher merges the rows back, weighting them. torch runs it as
one CUTLASS kernel only in bf16 on compute capability 9.x and 10.x (Hopper, B200/B300); on other
GPUs (8.x, 11.x, 12.x) and for fp16/fp32 it copies the offsets to the host and loops over the
experts (`hardware.evaluate` cites the source).
"""

from __future__ import annotations

import torch

from .base import StackedExperts, swiglu


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Rows `[offsets[e-1], offsets[e])` of x times w[e]^T for every expert e: x [R, K], w [E, N, K].

    Uses `torch._grouped_mm` where it takes these tensors; otherwise a loop of per-expert
    matmuls over the same sorted buffer (same result; the fallback is for CPUs, old torch, and
    shapes whose rows are not 16-byte aligned). Returns (result [R, N], which path ran).

    `offsets` [E] int32 are the experts' row ends (`torch.cumsum(m_splits, 0)`): non-decreasing,
    the last one R. Their values are checked where they are on the host (free) or copied there
    anyway (the loop); on a GPU's torch._grouped_mm path reading them would cost a host sync
    per GEMM, and the package's own offsets come from `routing.permute`, right by construction.
    """
    _check_grouped_mm_shapes(x, w, offsets)
    reason = grouped_mm_unusable(x, w)
    ends = None
    if reason is not None or not offsets.is_cuda:
        ends = offsets.tolist()
        _check_row_ends(ends, x.shape[0])
    if reason is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets), "torch._grouped_mm"
    starts = [0] + ends[:-1]
    out = torch.cat([x[s:t] @ w[e].T for e, (s, t) in enumerate(zip(starts, ends))])
    return out, f"per-expert matmul loop ({reason})"


_OFFSETS_FIX = "build them as torch.cumsum(m_splits, 0).to(torch.int32)"


def _check_grouped_mm_shapes(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_mm takes x [R, K] and w [E, N, K] with the same K, got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}: pass rows of the experts' "
                         f"input width")
    if offsets.shape != (w.shape[0],) or offsets.dtype != torch.int32:
        raise ValueError(f"offsets must be [E] int32 row ends, one per expert (E={w.shape[0]}), "
                         f"got shape {tuple(offsets.shape)} {offsets.dtype}: {_OFFSETS_FIX}")


def _check_row_ends(ends: list[int], num_rows: int) -> None:
    """Row ends must rise from 0 and end at the last row, or the GEMMs read and write past the
    rows they were given (torch._grouped_mm leaves such output rows uninitialised)."""
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end < start:
            raise ValueError(f"offsets[{e}]={end} is below {start}, where expert {e}'s rows "
                             f"start: row counts cannot be negative; {_OFFSETS_FIX}")
    if ends and ends[-1] != num_rows:
        raise ValueError(f"offsets end at row {ends[-1]} but x has {num_rows} rows: the "
                         f"experts' row counts must sum to the rows; {_OFFSETS_FIX}")


def grouped_mm_unusable(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why torch._grouped_mm cannot run these tensors, or None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 0):
        return "torch._grouped_mm needs compute capability >= 8.0"
    if x.is_cuda and x.dtype != torch.bfloat16:
        # torch accepts float32 and float16 too, but runs its one grouped kernel only for bf16:
        # other dtypes go to `_grouped_mm_fallback`, which copies the offsets to the host (a
        # sync) and loops over the experts (aten/src/ATen/native/cuda/GroupedBlas.cpp,
        # `_grouped_mm_cuda`); this loop is the same, the sync made visible.
        return (f"torch._grouped_mm runs one grouped kernel only in bfloat16; in {x.dtype} it "
                f"copies the offsets to the host and loops over the experts")
    # Its kernels read rows as 16-byte vectors: every row stride must be a multiple of 16 bytes.
    if any((n * t.element_size()) % 16 for t in (x, w) for n in (x.shape[-1], w.shape[-2])):
        return "row sizes are not multiples of 16 bytes"
    return None


class GroupedTorchExperts(StackedExperts):
    """Backend `grouped_torch`: two grouped GEMMs over all experts, SwiGLU between them."""

    backend = "grouped_torch"
    permutation = "sort"

    def grouped_mlp(self, rows: torch.Tensor, rows_per_expert: torch.Tensor) -> tuple[torch.Tensor, str]:
        """(the experts' outputs [R, H], which GEMM ran)."""
        offsets = torch.cumsum(rows_per_expert, 0).to(torch.int32)  # on the device: no sync per GEMM
        h, path = grouped_mm(rows, self.gate_up_proj, offsets)
        y, _ = grouped_mm(swiglu(h), self.down_proj, offsets)
        return y, path

    def forward(self, rows: torch.Tensor, rows_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        self.check_rows(rows, rows_per_expert)
        y, self.last_path = self.grouped_mlp(rows, rows_per_expert)
        return y
