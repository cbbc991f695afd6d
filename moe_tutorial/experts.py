"""The experts of a MoE layer: one weight layout, several ways to run it.

Every expert is a SwiGLU MLP, `down(silu(gate(x)) * up(x))`. `ExpertMLP` stores all experts'
weights stacked, in the layout of HF transformers 5 (`[out, in]` per expert, like `nn.Linear`):

    gate_up_proj  [E, 2I, H]   rows 0..I-1 are the gate projection, rows I..2I-1 the up projection
    down_proj     [E, H, I]

and a *backend* decides how the computation runs. Backends read the same parameters, so one
model switches backend (`experts.backend = "grouped_torch"`) without copying a weight:

* `naive` — a Python loop over the experts that received tokens, gathering each expert's tokens,
  running two small matmuls and scattering the result back. It is HF transformers' "eager"
  experts algorithm, step for step: correct, simple, and launch-bound (2 GEMMs + gathers per
  expert, many tiny kernels).
* `grouped_torch` — sort the token copies by expert once (`routing.permute`), then one grouped
  GEMM per projection over all experts (`torch._grouped_mm`, CUTLASS on sm_80+ GPUs), and one
  gather back (`routing.unpermute`).

Backends are registered in `BACKENDS` (name → function with the signature of `naive_experts`);
the GPU issue adds TE's `te_grouped_linear` and `te_ops` there. `ExpertMLP.last_path` says what
actually ran in the last forward pass (e.g. when `torch._grouped_mm` could not take the shapes
and the documented fallback ran instead).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .routing import permute, unpermute


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate-up projection: silu of the first half times the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def naive_experts(experts: ExpertMLP, hidden: torch.Tensor, indices: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """HF's eager experts loop: for each expert that received tokens, gather, MLP, scatter-add."""
    out = torch.zeros_like(hidden)
    with torch.no_grad():
        # [E, k, T] mask; which (slot, token) pairs chose each expert
        expert_mask = F.one_hot(indices, num_classes=experts.num_experts).permute(2, 1, 0)
        experts_hit = torch.nonzero(expert_mask.sum(dim=(-1, -2)) > 0).flatten().tolist()
    for e in experts_hit:  # one host sync per expert: the loop's shape depends on the routing
        slot, token = torch.where(expert_mask[e])
        h = swiglu(F.linear(hidden[token], experts.gate_up_proj[e]))
        y = F.linear(h, experts.down_proj[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    experts.last_path = f"naive loop over {len(experts_hit)} experts"
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Rows `[offsets[e-1], offsets[e])` of x times w[e]^T for every expert e: x [R, K], w [E, N, K].

    Uses `torch._grouped_mm` where it takes these tensors; otherwise a loop of per-expert
    matmuls over the same sorted buffer (same result; the fallback is for CPUs, old torch, and
    shapes whose rows are not 16-byte aligned). Returns (result [R, N], which path ran).
    """
    reason = _grouped_mm_unusable(x, w)
    if reason is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets), "torch._grouped_mm"
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    out = torch.cat([x[s:t] @ w[e].T for e, (s, t) in enumerate(zip(starts, ends))])
    return out, f"per-expert matmul loop ({reason})"


def _grouped_mm_unusable(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why torch._grouped_mm cannot run these tensors, or None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 0):
        return "torch._grouped_mm needs compute capability >= 8.0"
    if x.is_cuda and x.dtype != torch.bfloat16:
        return f"torch._grouped_mm on CUDA takes bfloat16, not {x.dtype}"
    # Its kernels read rows as 16-byte vectors: every row stride must be a multiple of 16 bytes.
    if any((n * t.element_size()) % 16 for t in (x, w) for n in (x.shape[-1], w.shape[-2])):
        return "row sizes are not multiples of 16 bytes"
    return None


def grouped_torch_experts(experts: ExpertMLP, hidden: torch.Tensor, indices: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """Permute once, two grouped GEMMs over all experts, unpermute once."""
    rows, _, perm = permute(hidden, indices, None, experts.num_experts)
    h, path = grouped_mm(rows, experts.gate_up_proj, perm.offsets)
    y, _ = grouped_mm(swiglu(h), experts.down_proj, perm.offsets)
    experts.last_path = path
    return unpermute(y, perm, weights)


ExpertBackend = Callable[["ExpertMLP", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS: dict[str, ExpertBackend] = {"naive": naive_experts, "grouped_torch": grouped_torch_experts}


class ExpertMLP(nn.Module):
    """E SwiGLU experts with stacked weights in HF transformers 5 layout; see the module doc."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 backend: str = "grouped_torch", *, dtype=None, device=None):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device))
        self.backend = backend
        self.last_path: str | None = None  # what the last forward pass ran

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"unknown expert backend {name!r}; available here: {sorted(BACKENDS)}")
        self._backend = name

    def forward(self, hidden: torch.Tensor, indices: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], indices [T, k] chosen experts, weights [T, k] their routing weights."""
        return BACKENDS[self._backend](self, hidden, indices, weights)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, backend={self._backend!r}")
