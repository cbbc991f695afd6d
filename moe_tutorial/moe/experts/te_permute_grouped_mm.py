"""Backend `te_permute_grouped_mm`: `grouped_torch`'s two grouped GEMMs on the same weights, fed
by TE's fused permutation kernels.

It asks the dispatcher for TE's `moe_permute_and_pad_with_probs` / `moe_unpermute`
(`permutation = "te"`, as the TE backends do) where TE runs on the tokens' GPU, and gets
`routing.permute` where it does not. Its offsets stay on the GPU, so where torch's CUTLASS
kernel runs (bf16, compute capability 9.x/10.x) the GEMMs need no host sync, and it has no
per-expert Python: for many small experts that makes it the fastest bf16 path measured on the
H200 (`registry.default_backend`). TE's permutation itself waits for the GPU to size its buffer
(`torch.equal`, `.item()`: transformer_engine/pytorch/permutation.py:1014, :1024 in TE 2.20.2).
"""

from __future__ import annotations

import torch

from ...precision import hardware
from .grouped_torch import GroupedTorchExperts
from .te_base import why_no_te


class TEPermuteGroupedMMExperts(GroupedTorchExperts):
    """Backend `te_permute_grouped_mm`."""

    backend = "te_permute_grouped_mm"
    permutation = "te"

    @property
    def uses_te(self) -> bool:
        """TE's permutation runs where the weights (and so the tokens) are on a CUDA GPU."""
        return self.gate_up_proj.is_cuda and hardware.transformer_engine() is not None

    def forward(self, rows: torch.Tensor, rows_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        self.check_rows(rows, rows_per_expert)
        y, path = self.grouped_mlp(rows, rows_per_expert)
        without_te = "" if self.uses_te else f" [pure-PyTorch counterpart: {why_no_te(rows.device)}]"
        self.last_path = f"{path} → SwiGLU → {path}{without_te}"
        return y
