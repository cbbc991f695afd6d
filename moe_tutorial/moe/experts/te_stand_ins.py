"""Transformer Engine's grouped-MLP modules in plain PyTorch: what the TE backends run where TE
does not (a CPU), with TE's parameter layout, call signatures and semantics, and what exercise
05's check builds with (`torch_ops`, addressed as `te.ops` is).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from .base import swiglu
from .grouped_torch import grouped_mm


def scaled_swiglu(gate_up: torch.Tensor, scales: torch.Tensor,
                  glu_interleave_size: int | None = None) -> torch.Tensor:
    """TE's `ScaledSwiGLU` in PyTorch: SwiGLU of each row times that row's scale (its routing
    weight), returned in the compute dtype.

    As TE 2.20 does (`ops/basic/swiglu.py`, `_ScaledGLU.fuser_forward`), the scales are first
    cast to the compute dtype — CUDA autocast's dtype when autocast is on, else the input's — so
    fp32 routing weights are applied rounded to bf16; the product is then formed in fp32."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else gate_up.dtype
    scales = scales.to(dtype).float().unsqueeze(-1)
    return (swiglu(gate_up.to(dtype).float(), glu_interleave_size) * scales).to(dtype)


def check_split_sizes(split_sizes, num_groups: int, num_rows: int) -> None:
    """Refuse the split sizes (a list, or a tensor as te.ops takes them) that TE's GroupedLinear
    refuses: not one per group, negative, or not summing to the rows. The values of a GPU tensor
    are left to `grouped_mm`, which checks them where it reads them."""
    is_tensor = isinstance(split_sizes, torch.Tensor)
    count = split_sizes.numel() if is_tensor else len(split_sizes)
    # TE 2.20: module/grouped_linear.py, GroupedLinear.forward ("Shape of splits tensor ... does
    # not match number of GEMMs") and ops/basic/grouped_linear.py, GroupedLinear.fuser_forward
    # ("Expected {num_groups} splits"), both ValueError.
    if count != num_groups:
        raise ValueError(f"expected {num_groups} split sizes, one per group (expert), got "
                         f"{count}: pass m_splits with a row count for every expert, zeros "
                         f"included")
    if is_tensor and split_sizes.is_cuda:
        return
    sizes = [int(n) for n in (split_sizes.tolist() if is_tensor else split_sizes)]
    # TE 2.20 splits the rows with torch.split(x, m_splits) (module/_split_quantization.py,
    # _split_quantize; ops/basic/grouped_linear.py, GroupedLinear._fuser_forward_split_quantize),
    # which refuses negative sizes and sizes that do not sum to the rows.
    if min(sizes, default=0) < 0:
        raise ValueError(f"split sizes {sizes} hold a negative row count: every expert's row "
                         f"count must be >= 0")
    if sum(sizes) != num_rows:
        raise ValueError(f"split sizes {sizes} sum to {sum(sizes)} rows but the input has "
                         f"{num_rows}: the row counts must add up to the input's rows")


class StandInGroupedLinear(nn.Module):
    """`te.ops.GroupedLinear` in PyTorch, with its constructor defaults (TE 2.20's
    `ops/basic/grouped_linear.py`, `reset_parameters`): per-group parameters `weight0 ..
    weight{G-1}` ([out, in], `kaiming_uniform_(a=sqrt(5))` each, as `nn.Linear` draws them) and,
    with bias=True (TE's default), `bias0 .. bias{G-1}` (zeros); `forward(x, split_sizes)`.
    (`te.GroupedLinear`, the module, draws its weights from N(0, 0.023²) instead.)"""

    num_extra_inputs = 1  # in a StandInSequential: the split sizes

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.num_groups = num_groups
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        for g in range(num_groups):
            weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
            self.register_parameter(f"weight{g}", nn.Parameter(
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5))))
        for g in range(num_groups):
            self.register_parameter(f"bias{g}", nn.Parameter(
                torch.zeros(out_features, dtype=dtype, device=device)) if bias else None)

    def forward(self, x: torch.Tensor, split_sizes) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear takes rows of {self.in_features} features, got "
                             f"shape {tuple(x.shape)}: pass x [rows, {self.in_features}]")
        check_split_sizes(split_sizes, self.num_groups, x.shape[0])
        weight = torch.stack([getattr(self, f"weight{g}") for g in range(self.num_groups)])
        splits = torch.as_tensor(split_sizes, device=x.device)
        y = grouped_mm(x, weight, torch.cumsum(splits, 0).to(torch.int32))[0]
        if not self.use_bias:
            return y
        bias = torch.stack([getattr(self, f"bias{g}") for g in range(self.num_groups)])
        return y + bias.repeat_interleave(splits, dim=0, output_size=x.shape[0])


class StandInScaledSwiGLU(nn.Module):
    """`te.ops.ScaledSwiGLU` in PyTorch (`scaled_swiglu`); its extra input is the per-row scales
    (the routing weights)."""

    num_extra_inputs = 1

    def __init__(self, glu_interleave_size: int | None = None):
        super().__init__()
        self.glu_interleave_size = glu_interleave_size

    def forward(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return scaled_swiglu(x, scales, self.glu_interleave_size)

    def extra_repr(self) -> str:
        return f"glu_interleave_size={self.glu_interleave_size}"


class StandInSequential(nn.Sequential):
    """`te.ops.Sequential` in PyTorch: `seq(x, *extra_inputs)` hands each op as many extra
    inputs as it takes (`num_extra_inputs`), in order."""

    def forward(self, x: torch.Tensor, *extra_inputs):
        wanted = sum(getattr(op, "num_extra_inputs", 0) for op in self)
        if len(extra_inputs) != wanted:
            raise ValueError(f"this op chain takes {wanted} extra inputs (one for each "
                             f"GroupedLinear and ScaledSwiGLU, in order), got {len(extra_inputs)}")
        extra = iter(extra_inputs)
        for op in self:
            x = op(x, *[next(extra) for _ in range(getattr(op, "num_extra_inputs", 0))])
        return x


# The three `te.ops` of the grouped MLP in PyTorch, addressed as te.ops is (`ops.Sequential(...)`):
# TEOpsExperts' op chain without TE, and what exercise 05's check builds with.
torch_ops = SimpleNamespace(Sequential=StandInSequential, GroupedLinear=StandInGroupedLinear,
                            ScaledSwiGLU=StandInScaledSwiGLU)


