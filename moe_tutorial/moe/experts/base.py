"""What every expert backend is: one contract, and the stacked weights most of them share.

An experts module never sees the routing. The dispatcher (`moe.dispatch`) has already sorted the
token copies by expert, so each expert owns one contiguous block of rows, and hands over

    experts(rows [R, H], rows_per_expert [E] int64, row_weights [R] or None) -> [R, H]

`rows_per_expert` are the block lengths (padding included: TE calls them `m_splits`), and
`row_weights` each row's routing weight, given only to a backend that applies the weights
itself (`applies_routing_weights`; the others leave them to the dispatcher's merge). What the
dispatcher must prepare is declared by the backend's class: `permutation` (which sort the
dispatcher runs: `PERMUTATIONS`) and `rows_alignment(recipe)` (each block's row count a multiple
of it). The experts' outputs come back in the same rows, and the dispatcher merges every
token's k outputs.

Every backend converts from any other (`from_experts`, through HF's stacked weight layout) and
reports `last_path`: what its last forward pass ran.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..routing import check_compute_dtype, check_expert_indices, check_routed_shapes

# The sorts a dispatcher runs for a backend (`Experts.permutation`):
#   "sort"          routing.permute: copies by expert, tokens in order within an expert
#   "sort_by_slot"  routing.permute(slot_major=True): each expert's copies by slot, then token
#   "te"            TE's fused moe_permute_and_pad_with_probs where TE runs on the tokens' GPU,
#                   else routing.permute
PERMUTATIONS = ("sort", "sort_by_slot", "te")


def swiglu(gate_up: torch.Tensor, glu_interleave_size: int | None = None) -> torch.Tensor:
    """SwiGLU on a fused gate-up projection: silu(gate) * up, where gate is the first half of the
    features and up the second — or, with `glu_interleave_size=n`, alternating blocks of n gate
    and n up features (TE's interleaved layout, see `te_ops.interleave_glu`)."""
    if glu_interleave_size:
        blocks = gate_up.unflatten(-1, (-1, 2, glu_interleave_size))
        gate, up = blocks.select(-2, 0).flatten(-2), blocks.select(-2, 1).flatten(-2)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Experts(nn.Module):
    """The contract of an expert backend (see the module doc). Subclasses set `backend` (their
    name in the registry), `permutation`, `applies_routing_weights`, and implement `forward`,
    `hf_weights`, `load_hf_weights` and `hf_gradients`."""

    backend: ClassVar[str] = ""
    permutation: ClassVar[str] = "sort"
    applies_routing_weights: ClassVar[bool] = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.last_path: str | None = None  # what the last forward pass ran

    def rows_alignment(self, recipe) -> int:
        """Rows per expert must be a multiple of this under `recipe` (a `recipes.RecipeSpec`, or
        None for no TE autocast): the dispatcher pads each expert's block to it."""
        return 1

    @property
    def uses_te(self) -> bool:
        """Whether this module runs Transformer Engine's kernels (TE backends on a GPU with TE)."""
        return False

    @classmethod
    def from_experts(cls, experts: Experts, **options) -> Experts:
        """A module of this backend with `experts`' weights (converted through the HF layout),
        on the same device and dtype."""
        gate_up, down = experts.hf_weights()
        new = cls(experts.num_experts, experts.hidden_size, experts.intermediate_size,
                  dtype=gate_up.dtype, device=gate_up.device, **options)
        new.load_hf_weights(gate_up, down)
        return new

    def hf_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the weights in HF layout: (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
        raise NotImplementedError

    def load_hf_weights(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        raise NotImplementedError

    def hf_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights' gradients in HF layout (after a backward pass)."""
        raise NotImplementedError

    def check_rows(self, rows: torch.Tensor, rows_per_expert: torch.Tensor) -> None:
        """Refuse rows and block lengths that do not fit these experts (shapes only: reading a
        GPU tensor's values would cost a host sync)."""
        if rows.dim() != 2 or rows.shape[1] != self.hidden_size:
            raise ValueError(f"the experts take sorted rows [R, {self.hidden_size}], got shape "
                             f"{tuple(rows.shape)}: pass the dispatcher's rows")
        if rows_per_expert.shape != (self.num_experts,):
            raise ValueError(f"rows_per_expert must hold one row count per expert "
                             f"({self.num_experts}), got shape {tuple(rows_per_expert.shape)}")

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}")


class StackedExperts(Experts):
    """E SwiGLU experts with their weights stacked in HF transformers 5's layout (`[out, in]`
    per expert, like `nn.Linear`):

        gate_up_proj  [E, 2I, H]   rows 0..I-1 the gate projection, rows I..2I-1 the up one
        down_proj     [E, H, I]

    Backends of this layout share the parameters themselves when converted into each other
    (`from_experts`): switching among them copies no weight, and an optimizer made before the
    switch still holds the model's parameters."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 dtype=None, device=None):
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device))

    @classmethod
    def from_experts(cls, experts: Experts, **options) -> Experts:
        if not isinstance(experts, StackedExperts):
            return super().from_experts(experts, **options)
        new = cls(experts.num_experts, experts.hidden_size, experts.intermediate_size,
                  device="meta", **options)
        new.gate_up_proj, new.down_proj = experts.gate_up_proj, experts.down_proj
        return new

    @torch.no_grad()
    def hf_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj.detach().clone(), self.down_proj.detach().clone()

    @torch.no_grad()
    def load_hf_weights(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        self.gate_up_proj.copy_(gate_up_proj)
        self.down_proj.copy_(down_proj)

    def hf_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj.grad, self.down_proj.grad

    def check_rows(self, rows: torch.Tensor, rows_per_expert: torch.Tensor) -> None:
        super().check_rows(rows, rows_per_expert)
        check_compute_dtype("the experts", rows, self.gate_up_proj.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"


def check_expert_inputs(experts: Experts, hidden: torch.Tensor, indices: torch.Tensor,
                        weights: torch.Tensor) -> None:
    """Refuse a layer's inputs that do not fit `experts` (any backend): shapes and dtypes (free),
    and expert indices outside [0, num_experts) where they are on the host
    (`routing.check_expert_indices`: on a GPU the router's top-k makes them, in range by
    construction, and reading them would cost a host sync per layer)."""
    check_routed_shapes(hidden, indices, weights)
    if hidden.shape[1] != experts.hidden_size or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden of shape {tuple(hidden.shape)} and dtype {hidden.dtype} does "
                         f"not fit these experts: pass floating-point [T, {experts.hidden_size}] "
                         f"(hidden_size={experts.hidden_size})")
    check_expert_indices(indices, experts.num_experts)
