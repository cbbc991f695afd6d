"""What the Transformer Engine backends share (`te_grouped_linear`, `te_ops`).

They keep the weights in TE's own per-expert parameters (`weight0 .. weight{E-1}` of each
grouped linear), so converting to or from them copies the weights through the HF layout
(`from_experts`, `hf_weights`). On a GPU they ask the dispatcher for TE's permutation kernels
(`moe_permute_and_pad_with_probs` / `moe_unpermute`), padding each expert's rows to what the
recipe of the enclosing `te.autocast` needs, read at every forward pass as TE's own ops read it
(`rows_alignment`; nothing sets it from outside). Without TE (a CPU) they run the pure-PyTorch
modules of `te_stand_ins` with the same parameters and the same semantics, and say so.

`cutlass=True` runs their grouped GEMMs, forward and backward, with TE's CUTLASS grouped kernel
instead of one cuBLAS GEMM per expert (`cutlass_grouped_gemm`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from ...precision import hardware, recipes
from .base import Experts

CUTLASS_GROUPED_GEMM_ENV = "NVTE_USE_CUTLASS_GROUPED_GEMM"


@contextlib.contextmanager
def cutlass_grouped_gemm() -> Iterator[None]:
    """Inside this block, TE's bf16 grouped GEMMs on Hopper may run as one CUTLASS grouped kernel
    instead of one cuBLAS GEMM per expert spread over several CUDA streams.

    TE reads `NVTE_USE_CUTLASS_GROUPED_GEMM` at every grouped GEMM call
    (`nvte_multi_tensor_gemm`, transformer_engine/common/gemm/cublaslt_gemm.cu, TE main@d0067d0,
    2.20.0.dev0), so the forward and the backward pass must both run inside the block (a TE
    backend built with `cutlass=True` does that itself). It takes the CUTLASS kernel only on
    compute capability 9.0, for bf16/fp16 GEMMs without bias or GELU epilogue whose K is the same
    for every expert and a multiple of 128; any other GEMM stays on cuBLAS. The weight-gradient
    GEMMs, whose K is each expert's row count, therefore usually stay on cuBLAS. It helps many
    small experts and costs a little on few large ones (the CUTLASS rows of
    benchmarks/results/h200.json), which is why nothing here turns it on by default."""
    previous = os.environ.get(CUTLASS_GROUPED_GEMM_ENV)
    os.environ[CUTLASS_GROUPED_GEMM_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[CUTLASS_GROUPED_GEMM_ENV]
        else:
            os.environ[CUTLASS_GROUPED_GEMM_ENV] = previous


class _CutlassInBackward(torch.autograd.Function):
    """An identity whose backward enters (`enter=True`, on the experts' output: it runs before
    their backward) or leaves (on their input rows: it runs after) `cutlass_grouped_gemm()`, so
    the experts' backward GEMMs run inside it as their forward ones do."""

    @staticmethod
    def forward(ctx, x, enter, scope):
        ctx.enter, ctx.scope = enter, scope
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.enter:
            ctx.scope.__enter__()
        else:
            ctx.scope.__exit__(None, None, None)
        return grad, None, None


def why_no_te(device: torch.device | None = None) -> str:
    """Why a backend runs its pure-PyTorch counterpart instead of TE's kernels here (`device`:
    where its tokens are, when that is what decides)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if device is not None and device.type != "cuda":
        return f"the tokens are on {device}, TE's kernels run on a CUDA GPU"
    return hardware.capabilities()["te_grouped_linear"].reason


class TEExperts(Experts):
    """The TE backends' sizes, alignment, weight conversion, CUTLASS option and stand-ins."""

    permutation = "te"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype=None,
                 device=None, align: int | None = None, cutlass: bool = False):
        super().__init__(num_experts, hidden_size, intermediate_size)
        # Rows per expert are padded to a multiple of what the active recipe needs, read at every
        # forward pass (`rows_alignment`); an int here fixes it instead (teaching, tests).
        self.align = align
        self.cutlass = cutlass
        on_gpu = device is not None and torch.device(device).type == "cuda"
        self._te = hardware.transformer_engine() if on_gpu else None

    def rows_alignment(self, recipe: recipes.RecipeSpec | None) -> int:
        """Rows per expert for a forward pass under `recipe` (None: bf16): TE's alignment for the
        recipe (`recipes.alignment`), unless this module was given a fixed `align`."""
        if self.align is not None:
            return self.align
        return recipes.alignment(recipe.name if recipe else None)

    @property
    def uses_te(self) -> bool:
        return self._te is not None

    def forward(self, rows: torch.Tensor, rows_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        self.check_rows(rows, rows_per_expert)
        if not self.cutlass:
            return self.grouped_mlp(rows, rows_per_expert, row_weights)
        scope = cutlass_grouped_gemm()
        if torch.is_grad_enabled() and rows.requires_grad:  # its backward leaves the scope
            rows = _CutlassInBackward.apply(rows, False, scope)
        with cutlass_grouped_gemm():
            y = self.grouped_mlp(rows, rows_per_expert, row_weights)
        self.last_path += " [NVTE_USE_CUTLASS_GROUPED_GEMM=1]"
        if torch.is_grad_enabled() and rows.requires_grad:
            y = _CutlassInBackward.apply(y, True, scope)
        return y

    def grouped_mlp(self, rows: torch.Tensor, rows_per_expert: torch.Tensor,
                    row_weights: torch.Tensor | None) -> torch.Tensor:
        """The backend's computation on the sorted rows (sets `last_path`)."""
        raise NotImplementedError

    def _fallback_note(self) -> str:
        return "" if self.uses_te else f" [pure-PyTorch counterpart: {why_no_te()}]"

    def _linears(self) -> tuple[nn.Module, nn.Module]:
        raise NotImplementedError

    def _fc1_rows(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up  # subclasses reorder rows (GLU interleave) here

    def _fc1_rows_to_hf(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    @torch.no_grad()
    def load_hf_weights(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        """Copy weights from the HF layout (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)."""
        fc1, fc2 = self._linears()
        for e in range(self.num_experts):
            getattr(fc1, f"weight{e}").copy_(self._fc1_rows(gate_up_proj[e]))
            getattr(fc2, f"weight{e}").copy_(down_proj[e])

    @torch.no_grad()
    def _stack_hf(self, of) -> tuple[torch.Tensor, torch.Tensor]:
        fc1, fc2 = self._linears()
        gate_up = torch.stack([self._fc1_rows_to_hf(of(getattr(fc1, f"weight{e}")))
                               for e in range(self.num_experts)])
        down = torch.stack([of(getattr(fc2, f"weight{e}")) for e in range(self.num_experts)])
        return gate_up, down

    def hf_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights in HF layout: (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
        return self._stack_hf(lambda w: w.detach().clone())

    def hf_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights' gradients in HF layout (after a backward pass)."""
        return self._stack_hf(lambda w: w.grad)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, "
                f"align={'from the active recipe' if self.align is None else self.align}, "
                f"{'cutlass grouped GEMM, ' if self.cutlass else ''}"
                f"{'Transformer Engine' if self.uses_te else 'pure-PyTorch counterpart'}")
