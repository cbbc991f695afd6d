"""The reference loop: every other expert backend computes what this one does, faster.

Each expert is a SwiGLU MLP, `down(silu(gate(x)) * up(x))`, its weights stacked with the other
experts' (`base.StackedExperts`: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`). The
dispatcher (`moe.dispatch`) has sorted the token copies by expert, so expert e's rows are one
block of `rows_per_expert[e]` rows; the loop runs each block through its expert with two small
matmuls and scales every output row by its routing weight.

This is HF transformers' "eager" experts algorithm, step for step: correct, simple, and
launch-bound (2 GEMMs and a few small kernels per expert, each waiting its turn). To keep HF's
order of sums, it asks the dispatcher for each expert's copies slot by slot
(`permutation = "sort_by_slot"`: HF's loop visits a token's first choices before its second).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import StackedExperts, swiglu


class NaiveExperts(StackedExperts):
    """Backend `naive`: a Python loop over the experts that received rows."""

    backend = "naive"
    permutation = "sort_by_slot"
    applies_routing_weights = True

    def forward(self, rows: torch.Tensor, rows_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """rows [R, H] sorted by expert, rows_per_expert [E], row_weights [R] (None: all 1)."""
        self.check_rows(rows, rows_per_expert)
        outputs, start = [], 0
        for e, count in enumerate(rows_per_expert.tolist()):  # one host sync: the loop's shape
            if count:
                block = rows[start:start + count]
                y = F.linear(swiglu(F.linear(block, self.gate_up_proj[e])), self.down_proj[e])
                if row_weights is not None:
                    y = y * row_weights[start:start + count, None]
                outputs.append(y.to(rows.dtype))
            start += count
        self.last_path = f"naive loop over {len(outputs)} experts"
        return torch.cat(outputs) if outputs else rows.new_zeros(rows.shape)
