"""Backend `te_grouped_linear`: two `te.GroupedLinear` modules (gate-up, down), SwiGLU between
them, the routing weights applied when the dispatcher merges the expert outputs back.
"""

from __future__ import annotations

from .base import swiglu
from .te_base import TEExperts
from .te_stand_ins import StandInGroupedLinear


class TEGroupedLinearExperts(TEExperts):
    """Backend `te_grouped_linear`: two `te.GroupedLinear`, SwiGLU between them, routing weights
    applied when the expert outputs are merged (`moe_unpermute`'s merging probabilities). The
    BioNeMo Mixtral recipe's "grouped_linear" mode applies them one step earlier, to the down
    projection's output in its dtype (`out * probs.to(out.dtype)` in
    `NVMixtralSparseMoeBlock._expert_ffn`, recipes/mixtral_native_te/modeling_mixtral_te.py,
    NVIDIA-BioNeMo/bionemo-recipes@e05e81a): the same sum, rounded differently."""

    backend = "te_grouped_linear"

    def __init__(self, num_experts, hidden_size, intermediate_size, *, dtype=None, device=None,
                 align: int | None = None, cutlass: bool = False):
        super().__init__(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device,
                         align=align, cutlass=cutlass)
        te = self._te
        for name, (n_in, n_out) in (("gate_up", (hidden_size, 2 * intermediate_size)),
                                    ("down", (intermediate_size, hidden_size))):
            linear = (te.GroupedLinear(num_experts, n_in, n_out, bias=False, params_dtype=dtype,
                                       device=device) if te is not None else
                      StandInGroupedLinear(num_experts, n_in, n_out, bias=False, dtype=dtype,
                                             device=device))
            self.add_module(name, linear)

    def _linears(self):
        return self.gate_up, self.down

    def grouped_mlp(self, rows, rows_per_expert, row_weights):
        # te.GroupedLinear takes its split sizes as a Python list: one host copy, which both
        # GEMMs share, forward and backward
        m_splits = rows_per_expert.tolist()
        y = self.down(swiglu(self.gate_up(rows, m_splits)), m_splits)
        impl = "te.GroupedLinear" if self.uses_te else "StandInGroupedLinear"
        self.last_path = f"{impl} → SwiGLU → {impl}" + self._fallback_note()
        return y
