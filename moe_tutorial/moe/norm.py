"""RMSNorm as the course's model runs it: HF Mixtral's arithmetic in one fused kernel, or (the
benchmark's candidate, `MoEForCausalLM.compiled_norms`) the norm and its weight's scaling as
torch.compile's kernels."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """weight * (x / rms(x)), HF Mixtral's arithmetic: x / rms(x) in fp32, rounded to x's dtype,
    then scaled by the weight. `F.rms_norm` computes in fp32 internally and runs as one fused
    kernel on a GPU, where HF's five elementwise ops each read and write the whole activation
    and keep two fp32 copies of it for the backward pass."""

    def __init__(self, size: int, eps: float, *, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        # The norm and its weight's scaling as one torch.compile'd kernel forward and one
        # backward (`MoEForCausalLM.compiled_norms`); eagerly they are separate kernels, each
        # reading and writing the whole activation
        self.compiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled:
            return _compiled_scaled_rms_norm()(x, self.weight, self.eps)
        return scaled_rms_norm(x, self.weight, self.eps)


def scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm`'s arithmetic: weight * (x / rms(x))."""
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


@functools.cache
def _compiled_scaled_rms_norm():
    return torch.compile(scaled_rms_norm, dynamic=False)
