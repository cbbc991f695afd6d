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
  GEMM per projection over all experts (`torch._grouped_mm`), and one gather back
  (`routing.unpermute`). torch runs it as one CUTLASS kernel only in bf16 on compute capability
  9.x and 10.x (Hopper, B200/B300); on other GPUs (8.x, 11.x, 12.x) and for fp16/fp32 it copies
  the offsets to the host and loops over the experts (`hardware.evaluate` cites the source).
* `te_permute_grouped_mm` — the same two `torch._grouped_mm` GEMMs on the same weights, fed by
  TE's fused permutation kernels (`moe_permute_and_pad_with_probs` / `moe_unpermute`, as the TE
  backends below use) where TE runs, `routing.permute` where it does not. Its offsets stay on
  the GPU, so where torch's CUTLASS kernel runs (bf16, compute capability 9.x/10.x) the GEMMs
  need no host sync, and it has no per-expert Python: for many small experts that makes it the
  fastest bf16 path measured on the H200 (`default_backend`). TE's permutation itself waits for
  the GPU to size its buffer (`torch.equal`, `.item()`: transformer_engine/pytorch/
  permutation.py:1014, :1024 in TE 2.20.2).

Two more backends run Transformer Engine. They keep the weights in TE's own per-expert
parameters (`weight0 .. weight{E-1}`), so switching to them converts the weights (both ways:
`convert_experts`, `hf_weights()`):

* `te_grouped_linear` — `TEGroupedLinearExperts`: two `te.GroupedLinear` (gate-up, down), SwiGLU
  in between, routing weights applied when the outputs are merged back.
* `te_ops` — `TEOpsExperts`: `te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`;
  the routing weights enter `ScaledSwiGLU`, so the whole expert MLP is one fusible op chain. On
  a B200/B300 (compute capability 10.x) with MXFP8 (or NVFP4), TE's fuser can replace the chain
  by `GroupedMLP_CuTeGEMMGLU` (TE 2.20, `ops/fused/grouped_mlp.py`). That is not one kernel:
  forward, ONE CuTe-DSL kernel runs FC1's grouped GEMM + SwiGLU + the routing-weight scale +
  the MXFP8 quantization of its output, then FC2 runs as a SEPARATE grouped GEMM
  (`grouped_gemm_quant_wrapper_sm100`); backward, FC2's dgrad is fused with dSwiGLU and the
  routing weights' gradient, while FC2's wgrad, FC1's dgrad and FC1's wgrad are separate
  grouped GEMMs. The fused kernels want the gate and up rows interleaved in blocks of 32
  (`glu_interleave_size=32`), which the weight conversion does (`interleave_glu`).
  `why_unfused` says which conditions make TE silently keep the three ops, `why_fused_raises`
  which shapes make the fused op raise instead.

On a GPU both use TE's permutation kernels (`moe_permute_and_pad_with_probs` / `moe_unpermute`),
padding each expert's rows to what the recipe of the enclosing `te.autocast` needs, read at every
forward pass as TE's own ops read it (`rows_alignment`; nothing sets it from outside). Without TE
(a CPU) they run pure-PyTorch modules with the same parameters and the same semantics, and say so.

Every experts module has `forward(hidden [T, H], indices [T, k], weights [T, k]) -> [T, H]`,
`.backend`, and `.last_path`: what actually ran in the last forward pass (e.g. when
`torch._grouped_mm` could not take the shapes and the documented fallback ran instead, or whether
TE fused the te.ops chain).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..precision import hardware, recipes
from .routing import (
    check_compute_dtype,
    check_expert_indices,
    check_routed_shapes,
    permute,
    unpermute,
)

# The fused grouped MLP's shape rules (TE 2.20, ops/fused/grouped_mlp.py; the 256 from TE's
# docs/examples/te_mixtral/te_moe_dispatch.py: the cuDNN kernel rejects per-expert row counts that
# are not multiples of 256). Breaking a condition of the first line makes TE's fuser keep the
# unfused ops; of the second, makes the fused op raise.
FUSED_MLP_GLU_INTERLEAVE, FUSED_MLP_FEATURE_MULTIPLE = 32, 64
FUSED_MLP_ROWS_PER_EXPERT, FUSED_MLP_TOTAL_ROWS_MULTIPLE = 256, 128
FUSED_MLP_RECIPES = ("MXFP8BlockScaling", "NVFP4BlockScaling")  # the recipes the fuser accepts

# The backends on `ExpertMLP`'s stacked weights, then those with TE's own per-expert parameters
TORCH_BACKENDS = ("naive", "grouped_torch", "te_permute_grouped_mm", "sync_free", "sync_free_fp8",
                  "sync_free_fp8_wgrad")
TE_BACKENDS = ("te_grouped_linear", "te_ops")
EXPERT_BACKENDS = TORCH_BACKENDS + TE_BACKENDS


def swiglu(gate_up: torch.Tensor, glu_interleave_size: int | None = None) -> torch.Tensor:
    """SwiGLU on a fused gate-up projection: silu(gate) * up, where gate is the first half of the
    features and up the second — or, with `glu_interleave_size=n`, alternating blocks of n gate
    and n up features (TE's interleaved layout, see `interleave_glu`)."""
    if glu_interleave_size:
        blocks = gate_up.unflatten(-1, (-1, 2, glu_interleave_size))
        gate, up = blocks.select(-2, 0).flatten(-2), blocks.select(-2, 1).flatten(-2)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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


def interleave_glu(gate_up_weight: torch.Tensor, block: int) -> torch.Tensor:
    """[..., 2I, H] rows (I gate rows, then I up rows) → blocks of `block` gate rows alternating
    with `block` up rows: the layout TE's `glu_interleave_size=block` reads."""
    *lead, rows, cols = gate_up_weight.shape
    half = rows // 2
    if rows % 2 or half % block:
        raise ValueError(f"the intermediate size {half} must be a multiple of the GLU interleave "
                         f"block {block}")
    gate, up = gate_up_weight.split(half, dim=-2)
    pairs = torch.stack((gate.unflatten(-2, (-1, block)), up.unflatten(-2, (-1, block))), dim=-3)
    return pairs.reshape(*lead, rows, cols)


def deinterleave_glu(weight: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `interleave_glu`."""
    *lead, rows, cols = weight.shape
    pairs = weight.reshape(*lead, rows // (2 * block), 2, block, cols)
    return torch.cat((pairs.select(-3, 0).flatten(-3, -2), pairs.select(-3, 1).flatten(-3, -2)),
                     dim=-2)


def naive_experts(experts: ExpertMLP, hidden: torch.Tensor, indices: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """HF's eager experts loop: for each expert that received tokens, gather, MLP, scatter-add."""
    out = torch.zeros_like(hidden)
    with torch.no_grad():
        # [E, k, T] mask; which (slot, token) pairs chose each expert (one_hot takes int64 only)
        expert_mask = F.one_hot(indices.long(), num_classes=experts.num_experts).permute(2, 1, 0)
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

    `offsets` [E] int32 are the experts' row ends (`torch.cumsum(m_splits, 0)`): non-decreasing,
    the last one R. Their values are checked where they are on the host (free) or copied there
    anyway (the loop); on a GPU's torch._grouped_mm path reading them would cost a host sync
    per GEMM, and the package's own offsets come from `routing.permute`, right by construction.
    """
    _check_grouped_mm_shapes(x, w, offsets)
    reason = _grouped_mm_unusable(x, w)
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


def te_permute_grouped_mm_experts(experts: ExpertMLP, hidden: torch.Tensor, indices: torch.Tensor,
                                  weights: torch.Tensor) -> torch.Tensor:
    """TE's permutation kernels (which wait for the GPU twice: whether to pad, and the buffer's
    size) around the two grouped GEMMs of `grouped_torch_experts`, the routing weights applied
    when the rows are merged; on a CPU or without TE, `routing.permute` / `routing.unpermute`
    with the same result."""
    te = hardware.transformer_engine() if hidden.is_cuda else None
    d = dispatch(hidden, indices, weights, experts.num_experts, 1, te)
    offsets = torch.cumsum(d.m_splits, 0).to(torch.int32)  # on the device: no sync per GEMM
    h, path = grouped_mm(d.rows, experts.gate_up_proj, offsets)
    y, _ = grouped_mm(swiglu(h), experts.down_proj, offsets)
    without_te = "" if te is not None else f" [pure-PyTorch counterpart: {_why_no_te(hidden.device)}]"
    experts.last_path = f"{d.path} → {path} → SwiGLU → {path}{without_te}"
    return d.combine(y, True)


def _why_no_te(device: torch.device | None = None) -> str:
    """Why a backend runs its pure-PyTorch counterpart instead of TE's kernels here (`device`:
    where its tokens are, when that is what decides)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if device is not None and device.type != "cuda":
        return f"the tokens are on {device}, TE's kernels run on a CUDA GPU"
    return hardware.capabilities()["te_grouped_linear"].reason


# The largest expert, in weight elements per projection (hidden × intermediate), for which
# `default_backend` picks `te_permute_grouped_mm` in bf16; above it, `te_ops`. From the expert
# layer's bf16 rows in benchmarks/results/h200.json (forward + backward, balanced routing):
# TE's permutation around torch._grouped_mm was the fastest bf16 path for every shape of at most
# 2048 × 7168 = 14.7M elements (the small, OLMoE, Qwen3, fine-grained and DeepSeek-V3 shapes;
# DeepSeek-V3's by under 1% over TE's GroupedLinear, a tie), and te.ops was for Mixtral's
# 4096 × 14336 = 58.7M (its cuBLAS GEMMs beat the CUTLASS grouped kernel there). The boundary
# lies between the two; `tests/test_experts.py` checks the rule against the committed rows.
SMALL_EXPERT_ELEMENTS = 16 * 2**20


def default_backend(hidden_size: int, intermediate_size: int, *, fp8: bool,
                    te_on_gpu: bool) -> str:
    """The expert backend the course picks for experts of this width: `te_ops` under an FP8
    recipe (FP8 runs through TE's GroupedLinear), `te_permute_grouped_mm` in bf16 for experts of
    at most `SMALL_EXPERT_ELEMENTS` weights per projection, `te_ops` for larger ones; without
    TE on a GPU (`te_on_gpu=False`), `grouped_torch`, the pure-PyTorch grouped path."""
    if not te_on_gpu:
        if fp8:
            raise ValueError("FP8 experts need Transformer Engine on a GPU; this machine has "
                             "none (train in bf16, or see recipes.recipe_for for the emulation)")
        return "grouped_torch"
    if fp8 or hidden_size * intermediate_size > SMALL_EXPERT_ELEMENTS:
        return "te_ops"
    return "te_permute_grouped_mm"


def check_expert_inputs(experts: nn.Module, hidden: torch.Tensor, indices: torch.Tensor,
                        weights: torch.Tensor) -> None:
    """Refuse a forward pass's inputs that do not fit `experts` (any backend): shapes and dtypes
    (free), and expert indices outside [0, num_experts) where they are on the host
    (`routing.check_expert_indices`: on a GPU the router's top-k makes them, in range by
    construction, and reading them would cost a host sync per layer)."""
    check_routed_shapes(hidden, indices, weights)
    if hidden.shape[1] != experts.hidden_size or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden of shape {tuple(hidden.shape)} and dtype {hidden.dtype} does "
                         f"not fit these experts: pass floating-point [T, {experts.hidden_size}] "
                         f"(hidden_size={experts.hidden_size})")
    check_expert_indices(indices, experts.num_experts)


# Backends that run FP8 GEMMs of their own in a bf16 model (no te.autocast around them)
SELF_QUANTIZING_BACKENDS = ("sync_free_fp8", "sync_free_fp8_wgrad")

ExpertBackend = Callable[["ExpertMLP", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS: dict[str, ExpertBackend] = {"naive": naive_experts, "grouped_torch": grouped_torch_experts,
                                      "te_permute_grouped_mm": te_permute_grouped_mm_experts}
# `sync_free`, `sync_free_fp8` and `sync_free_fp8_wgrad` are added by `moe.sync_free` when it is
# imported (the package's `moe/__init__.py` imports it)


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
        check_expert_inputs(self, hidden, indices, weights)
        check_compute_dtype("the experts", hidden, self.gate_up_proj.dtype)
        return BACKENDS[self._backend](self, hidden, indices, weights)

    @torch.no_grad()
    def hf_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj): this module's own layout is the HF layout."""
        return self.gate_up_proj.detach().clone(), self.down_proj.detach().clone()

    @torch.no_grad()
    def load_hf_weights(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        self.gate_up_proj.copy_(gate_up_proj)
        self.down_proj.copy_(down_proj)

    def hf_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj.grad, self.down_proj.grad

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, backend={self._backend!r}")


# ---------------------------------------------------------------------------------------------
# Transformer Engine backends (pure-PyTorch counterparts where TE is absent)


@dataclass
class Dispatched:
    """Token copies sorted by expert, ready for grouped GEMMs, and how to put them back."""

    rows: torch.Tensor  # [R, H], each expert's rows padded to the alignment with zero rows
    row_weights: torch.Tensor  # [R] fp32 routing weight of each row (0 on padding)
    m_splits: torch.Tensor  # [E] int64 rows per expert (padded)
    combine: Callable[[torch.Tensor, bool], torch.Tensor]  # (expert rows, apply weights?) -> [T, H]
    path: str  # which permutation ran


def dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
             num_experts: int, align: int, te=None) -> Dispatched:
    """Permute token copies to their experts: TE's fused kernels when `te` is given, else
    `routing.permute` (the reference, same result)."""
    if te is None:
        rows, row_weights, perm = permute(hidden, indices, weights, num_experts, align)
        return Dispatched(rows, row_weights, perm.m_splits,
                          lambda y, merge: unpermute(y, perm, weights if merge else None),
                          "routing.permute")
    num_tokens, indices = hidden.shape[0], indices.long()  # scatter takes int64 indices only
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.int32, device=hidden.device)
    routing_map.scatter_(1, indices, 1)
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float32,
                        device=hidden.device).scatter(1, indices, weights.float())
    rows, row_weights, row_id_map, pad_offsets, m_splits = te.moe_permute_and_pad_with_probs(
        hidden, probs, routing_map, routing_map.sum(0), align)

    def combine(y, merge):
        return te.moe_unpermute(y, row_id_map, merging_probs=probs if merge else None,
                                restore_shape=hidden.shape, pad_offsets=pad_offsets)

    return Dispatched(rows, row_weights, m_splits, combine, "te.moe_permute_and_pad_with_probs")


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


class ReferenceGroupedLinear(nn.Module):
    """`te.ops.GroupedLinear` in PyTorch, with its constructor defaults (TE 2.20's
    `ops/basic/grouped_linear.py`, `reset_parameters`): per-group parameters `weight0 ..
    weight{G-1}` ([out, in], `kaiming_uniform_(a=sqrt(5))` each, as `nn.Linear` draws them) and,
    with bias=True (TE's default), `bias0 .. bias{G-1}` (zeros); `forward(x, split_sizes)`.
    (`te.GroupedLinear`, the module, draws its weights from N(0, 0.023²) instead.)"""

    num_extra_inputs = 1  # in a ReferenceSequential: the split sizes

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


class ReferenceScaledSwiGLU(nn.Module):
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


class ReferenceSequential(nn.Sequential):
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
torch_ops = SimpleNamespace(Sequential=ReferenceSequential, GroupedLinear=ReferenceGroupedLinear,
                            ScaledSwiGLU=ReferenceScaledSwiGLU)


class _TEExperts(nn.Module):
    """What the two TE backends share: sizes, alignment, weight conversion, which path ran."""

    backend = ""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype=None,
                 device=None, align: int | None = None):
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        # Rows per expert are padded to a multiple of what the active recipe needs, read at every
        # forward pass (`rows_alignment`); an int here fixes it instead (teaching, tests).
        self.align = align
        on_gpu = device is not None and torch.device(device).type == "cuda"
        self._te = hardware.transformer_engine() if on_gpu else None
        self.last_path: str | None = None

    def rows_alignment(self, recipe: recipes.RecipeSpec | None) -> int:
        """Rows per expert for a forward pass under `recipe` (None: bf16): TE's alignment for the
        recipe (`recipes.alignment`), unless this module was given a fixed `align`."""
        if self.align is not None:
            return self.align
        return recipes.alignment(recipe.name if recipe else None)

    @property
    def uses_te(self) -> bool:
        return self._te is not None

    def _fallback_note(self) -> str:
        return "" if self.uses_te else f" [pure-PyTorch counterpart: {_why_no_te()}]"

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
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, "
                f"align={'from the active recipe' if self.align is None else self.align}, "
                f"{'Transformer Engine' if self.uses_te else 'pure-PyTorch counterpart'}")


class TEGroupedLinearExperts(_TEExperts):
    """Backend `te_grouped_linear`: two `te.GroupedLinear`, SwiGLU between them, routing weights
    applied when the expert outputs are merged (`moe_unpermute`'s merging probabilities). The
    BioNeMo Mixtral recipe's "grouped_linear" mode applies them one step earlier, to the down
    projection's output in its dtype (`out * probs.to(out.dtype)` in
    `NVMixtralSparseMoeBlock._expert_ffn`, recipes/mixtral_native_te/modeling_mixtral_te.py,
    NVIDIA-BioNeMo/bionemo-recipes@e05e81a): the same sum, rounded differently."""

    backend = "te_grouped_linear"

    def __init__(self, num_experts, hidden_size, intermediate_size, *, dtype=None, device=None,
                 align: int | None = None):
        super().__init__(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device,
                         align=align)
        te = self._te
        for name, (n_in, n_out) in (("gate_up", (hidden_size, 2 * intermediate_size)),
                                    ("down", (intermediate_size, hidden_size))):
            linear = (te.GroupedLinear(num_experts, n_in, n_out, bias=False, params_dtype=dtype,
                                       device=device) if te is not None else
                      ReferenceGroupedLinear(num_experts, n_in, n_out, bias=False, dtype=dtype,
                                             device=device))
            self.add_module(name, linear)

    def _linears(self):
        return self.gate_up, self.down

    def forward(self, hidden, indices, weights):
        check_expert_inputs(self, hidden, indices, weights)
        align = self.rows_alignment(recipes.active_recipe())
        d = dispatch(hidden, indices, weights, self.num_experts, align, self._te)
        m_splits = d.m_splits.tolist()  # one host copy, shared by both GEMMs
        y = self.down(swiglu(self.gate_up(d.rows, m_splits)), m_splits)
        impl = "te.GroupedLinear" if self.uses_te else "ReferenceGroupedLinear"
        self.last_path = (f"{d.path} (align {align}) → {impl} → SwiGLU → {impl}"
                          + self._fallback_note())
        return d.combine(y, True)


def why_unfused(capabilities: hardware.Capabilities, recipe, glu_interleave_size: int | None,
                hidden_size: int, intermediate_size: int) -> list[str]:
    """Every reason TE's fuser would silently keep the te.ops grouped MLP unfused here (empty:
    it fuses). `recipe`: None (bf16), a recipe name, a `recipes.RecipeSpec` or a TE recipe.

    TE 2.20's conditions (`ops/fused/grouped_mlp.py`): `GroupedMLP_CuTeGEMMGLU.is_supported()`
    (the environment variable, compute capability 10.x, cudnn-frontend >= 1.23, the kernels
    importable: the capability table's `fused_grouped_mlp` row), then in `fuse_grouped_mlp_ops`
    an MXFP8 recipe with an E4M3 backward format or an NVFP4 recipe with its random Hadamard
    transform, FC1/FC2 feature sizes multiples of 64 and `glu_interleave_size=32`. Row counts are
    not among them: once fused, bad row counts raise (`why_fused_raises`)."""
    reasons = []
    fused = capabilities["fused_grouped_mlp"]
    if fused.status != hardware.NATIVE:
        reasons.append(fused.reason)
    spec = recipes.recipe_spec(recipe)
    if spec is None or spec.name not in FUSED_MLP_RECIPES:
        reasons.append(f"the fused kernel needs an MXFP8 or NVFP4 recipe, this runs "
                       f"{spec.name if spec else 'bf16 (no recipe)'}")
    elif spec.name == "MXFP8BlockScaling" and spec.backward_format != "E4M3":
        reasons.append(f"MXFP8 with fp8_format={spec.fp8_format} has an {spec.backward_format} "
                       f"backward pass; the fused kernel reads gradients as E4M3 (use Format.E4M3)")
    elif spec.name == "NVFP4BlockScaling" and spec.disable_rht:
        reasons.append("NVFP4 with disable_rht=True; the fused kernel's grouped quantization "
                       "needs the random Hadamard transform")
    if glu_interleave_size != FUSED_MLP_GLU_INTERLEAVE:
        reasons.append(f"it needs glu_interleave_size={FUSED_MLP_GLU_INTERLEAVE}, this uses "
                       f"{glu_interleave_size}")
    if hidden_size % FUSED_MLP_FEATURE_MULTIPLE or intermediate_size % FUSED_MLP_FEATURE_MULTIPLE:
        reasons.append(f"feature sizes must be multiples of {FUSED_MLP_FEATURE_MULTIPLE} (hidden "
                       f"{hidden_size}, intermediate {intermediate_size})")
    return reasons


def why_fused_raises(m_splits) -> list[str]:
    """The shape conditions under which the fused grouped MLP, once TE chose it, raises instead
    of running: no rows at all (every local expert empty, as under expert parallelism a rank's
    experts can be: the CuTe-DSL kernel builds its TMA descriptor over the token dimension and
    fails on 0 rows; the BioNeMo recipe runs one masked 256-row group instead, `_expert_ffn_fused`
    in recipes/mixtral_native_te/modeling_mixtral_te.py@e05e81a), a total row count not
    divisible by 128 (TE's `ValueError` in `fuser_forward`, ops/fused/grouped_mlp.py:1203-1204)
    and per-expert row counts that are not multiples of 256 (the cuDNN kernel). Padding every
    expert to `FUSED_MLP_ROWS_PER_EXPERT` rows satisfies the last two; padding cannot help the
    first (an empty expert stays at 0 rows)."""
    splits = [int(n) for n in torch.as_tensor(m_splits).reshape(-1).tolist()]
    if splits and not any(splits):
        return [f"every one of the {len(splits)} experts has 0 rows: the fused kernel fails on an "
                f"empty input (run one masked group of {FUSED_MLP_ROWS_PER_EXPERT} zero rows "
                f"instead, as the BioNeMo recipe does)"]
    reasons = []
    if sum(splits) % FUSED_MLP_TOTAL_ROWS_MULTIPLE:
        reasons.append(f"{sum(splits)} rows in all is not a multiple of "
                       f"{FUSED_MLP_TOTAL_ROWS_MULTIPLE} (TE raises ValueError)")
    ragged = [e for e, n in enumerate(splits) if n % FUSED_MLP_ROWS_PER_EXPERT]
    if ragged:
        reasons.append(f"expert(s) {ragged[:8]}{'...' if len(ragged) > 8 else ''} have row "
                       f"counts that are not multiples of {FUSED_MLP_ROWS_PER_EXPERT} (the cuDNN "
                       f"kernel rejects them): pad with align={FUSED_MLP_ROWS_PER_EXPERT}")
    return reasons


class TEOpsExperts(_TEExperts):
    """Backend `te_ops`: `te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)` with the
    routing weights fed to ScaledSwiGLU and the same split tensor passed to both GEMMs.

    After each forward pass `fused` says whether TE's fuser replaced the three ops by the fused
    CuTe-DSL grouped MLP (read from the fuser itself), and `last_path` says why not when not.
    `require_fused=True` raises instead of running unfused, as the BioNeMo recipe does.
    """

    backend = "te_ops"

    def __init__(self, num_experts, hidden_size, intermediate_size, *, dtype=None, device=None,
                 align: int | None = None, glu_interleave_size: int | None = None,
                 require_fused: bool = False):
        super().__init__(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device,
                         align=align)
        self.glu_interleave_size = glu_interleave_size
        self.require_fused = require_fused
        self.fused: bool | None = None
        ops = self._te.ops if self.uses_te else torch_ops
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.mlp = ops.Sequential(
            ops.GroupedLinear(num_experts, hidden_size, 2 * intermediate_size, **kw),
            ops.ScaledSwiGLU(glu_interleave_size=glu_interleave_size),
            ops.GroupedLinear(num_experts, intermediate_size, hidden_size, **kw))

    def _linears(self):
        return self.mlp[0], self.mlp[2]

    def _fc1_rows(self, gate_up):
        return interleave_glu(gate_up, self.glu_interleave_size) if self.glu_interleave_size else gate_up

    def _fc1_rows_to_hf(self, weight):
        return deinterleave_glu(weight, self.glu_interleave_size) if self.glu_interleave_size else weight

    def fused_ops(self) -> list[str]:
        """Class names of the ops TE's fuser chose for the forward pass (after one forward)."""
        groups = getattr(self.mlp, "_module_groups", None) or []
        return [type(op).__name__ for g in groups for op, _ in getattr(g, "_forward_ops", [])]

    def rows_alignment(self, recipe):
        """As for every TE backend, and 256 rows per expert where the fused grouped MLP can run
        (the 32-wide interleave under a recipe it accepts), whose kernel raises on fewer."""
        align = super().rows_alignment(recipe)
        fusable = (self.glu_interleave_size == FUSED_MLP_GLU_INTERLEAVE and recipe is not None
                   and recipe.name in FUSED_MLP_RECIPES)
        return max(align, FUSED_MLP_ROWS_PER_EXPERT) if fusable and self.align is None else align

    def forward(self, hidden, indices, weights):
        check_expert_inputs(self, hidden, indices, weights)
        recipe = recipes.active_recipe()
        align = self.rows_alignment(recipe)
        d = dispatch(hidden, indices, weights, self.num_experts, align, self._te)
        splits = d.m_splits  # the same tensor object for both GEMMs
        y = self.mlp(d.rows, splits, d.row_weights, splits)
        if self.uses_te:
            ops = self.fused_ops()
            self.fused = any(name.startswith("GroupedMLP") for name in ops)
            if self.fused:
                self.last_path = f"{d.path} (align {align}) → te.ops fused {ops}"
            else:
                reasons = why_unfused(hardware.capabilities(), recipe,
                                      self.glu_interleave_size, self.hidden_size,
                                      self.intermediate_size)
                why = "; ".join(reasons) or "TE's fuser declined (conditions above all met)"
                if self.require_fused:
                    raise RuntimeError(f"te.ops grouped MLP ran unfused and require_fused=True: {why}")
                self.last_path = (f"{d.path} (align {align}) → te.ops unfused "
                                  f"{ops}: {why}")
        else:
            self.fused = False
            self.last_path = (f"{d.path} (align {align}) → GroupedLinear → ScaledSwiGLU → "
                              f"GroupedLinear" + self._fallback_note())
        return d.combine(y, False)


CUTLASS_GROUPED_GEMM_ENV = "NVTE_USE_CUTLASS_GROUPED_GEMM"


@contextlib.contextmanager
def cutlass_grouped_gemm() -> Iterator[None]:
    """Inside this block, TE's bf16 grouped GEMMs on Hopper may run as one CUTLASS grouped kernel
    instead of one cuBLAS GEMM per expert spread over several CUDA streams.

    TE reads `NVTE_USE_CUTLASS_GROUPED_GEMM` at every grouped GEMM call
    (`nvte_multi_tensor_gemm`, transformer_engine/common/gemm/cublaslt_gemm.cu, TE main@d0067d0,
    2.20.0.dev0), so the forward and the backward pass must both run inside the block. It takes
    the CUTLASS kernel only on compute capability 9.0, for bf16/fp16 GEMMs without bias or GELU
    epilogue whose K is the same for every expert and a multiple of 128; any other GEMM stays on
    cuBLAS. The weight-gradient GEMMs, whose K is each expert's row count, therefore usually stay
    on cuBLAS. It helps many small experts and costs a little on few large ones (the `+cutlass`
    rows of benchmarks/results/h200.json), which is why nothing here turns it on."""
    previous = os.environ.get(CUTLASS_GROUPED_GEMM_ENV)
    os.environ[CUTLASS_GROUPED_GEMM_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[CUTLASS_GROUPED_GEMM_ENV]
        else:
            os.environ[CUTLASS_GROUPED_GEMM_ENV] = previous


TE_EXPERT_CLASSES = {"te_grouped_linear": TEGroupedLinearExperts, "te_ops": TEOpsExperts}
# What each backend runs of Transformer Engine, which a machine without it replaces by PyTorch.
TE_PARTS = {"te_grouped_linear": "te.GroupedLinear", "te_ops": "te.ops' grouped MLP",
            "te_permute_grouped_mm": "TE's permutation kernels"}


def backend_label(experts: nn.Module) -> str:
    """The experts module's backend as a figure's legend or a table should name it: the backend,
    and where its Transformer Engine part does not run here (no TE, or not on a CUDA device),
    what runs instead, e.g. "te_grouped_linear: pure-PyTorch stand-in of te.GroupedLinear"."""
    backend = experts.backend
    if backend not in TE_PARTS:
        return backend
    if isinstance(experts, _TEExperts):
        runs_te = experts.uses_te
    else:  # te_permute_grouped_mm on ExpertMLP: TE's kernels where its weights (and tokens) are on CUDA
        runs_te = experts.gate_up_proj.is_cuda and hardware.transformer_engine() is not None
    return backend if runs_te else f"{backend}: pure-PyTorch stand-in of {TE_PARTS[backend]}"


def convert_experts(experts: nn.Module, backend: str, **options) -> nn.Module:
    """An experts module running `backend` with the same weights as `experts`.

    Between the torch backends this only switches `experts.backend` (they share parameters);
    to or from a TE backend the weights are converted (copied) through the HF layout.
    `options` go to the TE classes (`align`, and for te_ops `glu_interleave_size`,
    `require_fused`)."""
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"unknown expert backend {backend!r}; choose one of {EXPERT_BACKENDS}")
    if backend in TORCH_BACKENDS and options:
        raise ValueError(f"backend {backend!r} takes no options, got {sorted(options)}")
    if isinstance(experts, ExpertMLP) and backend in TORCH_BACKENDS:
        experts.backend = backend
        return experts
    gate_up, down = experts.hf_weights()
    sizes = (experts.num_experts, experts.hidden_size, experts.intermediate_size)
    where = {"dtype": gate_up.dtype, "device": gate_up.device}
    if backend in TORCH_BACKENDS:
        new = ExpertMLP(*sizes, backend, **where)
    else:
        new = TE_EXPERT_CLASSES[backend](*sizes, **where, **options)
    new.load_hf_weights(gate_up, down)
    return new
